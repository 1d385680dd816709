"""06: what ``nvidia-smi`` shows against what the memory engine counts, on a CUDA device.

The memory engine (:mod:`course_lib.prediction.engine`) predicts what
``torch.cuda.max_memory_allocated`` reports. ``nvidia-smi`` shows more, for four reasons, each
measured here:

* **Reserved, not allocated.** The caching allocator keeps freed blocks for reuse:
  ``torch.cuda.memory_reserved()`` is at least ``memory_allocated()``, and ``nvidia-smi`` sees it.
* **The CUDA context.** The driver's state and the code of the kernels loaded (PyTorch's,
  cuBLAS', cuDNN's): hundreds of MiB no allocator counts, measured as the device's used memory
  (``torch.cuda.mem_get_info``) minus what the allocator reserved.
* **The cuBLAS workspace.** The first matmul on a stream allocates one (some MiB, more on
  Hopper): ``memory_allocated`` counts it, a step's peak does not.
* **Fragmentation.** Freed blocks that later, larger requests cannot use stay reserved. The
  remedy is ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch's "CUDA semantics"
  notes), read once when CUDA initialises: :func:`probe` measures in a fresh process.

Without CUDA every measuring function returns a :class:`NotOnCUDA` that says why; the pure
helpers work everywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from course_lib.units import MiB, format_bytes
from course_lib.validation import WrongTypeError, boolean, fields, integer, number, text

#: The largest request :func:`probe` makes, in MiB (1 TiB), and the longest it waits, in seconds.
MAX_PROBE_MIB = 2**20
MAX_PROBE_SECONDS = 86_400.0

#: The environment variable the CUDA caching allocator reads its options from (every torch the
#: course supports). Newer releases (2.8 and later) read ``PYTORCH_ALLOC_CONF`` first, for every
#: accelerator: :data:`ALLOC_CONF_VARS` holds both.
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: Sizes (MiB) of the growing requests :func:`probe` makes to fragment the cache: a buffer that
#: grows a little from step to step, as with batches of varying length.
FRAGMENTING_SIZES_MIB = (32, 36, 40, 44, 48, 52, 56, 60)


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class NotOnCUDA:
    """The falsy result of a measurement that needs CUDA; its ``reason`` (also its ``str``) says
    why."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason


def _not_on_cuda(device: torch.device | str | int | None = None) -> NotOnCUDA | None:
    """``None`` if ``device`` is a usable CUDA device, else the :class:`NotOnCUDA` saying why."""
    device = _device(device)
    if device.type != "cuda":
        return NotOnCUDA(f"not on CUDA: the device is {device.type}, where there is no CUDA caching "
                         "allocator, CUDA context or cuBLAS workspace to measure")
    if not torch.cuda.is_available():
        return NotOnCUDA("not on CUDA: this machine has no CUDA device, so there is no CUDA caching "
                         "allocator, CUDA context or cuBLAS workspace to measure")
    return None


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", integer("device", device, minimum=0, maximum=1023))
    if not isinstance(device, str | torch.device):
        raise WrongTypeError(f"device must be a torch.device, a device string or a CUDA index, "
                         f"got {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch.device, a device string or a CUDA index, "
                         f"got {device!r}") from None


@dataclass(frozen=True)
class Reading:
    """One reading of the caching allocator and of the driver, in bytes (``torch.cuda``'s
    ``memory_allocated``, ``memory_reserved``, ``mem_get_info`` and the peaks since a reset)."""

    allocated: int
    reserved: int
    free: int
    total: int
    peak_allocated: int = 0
    peak_reserved: int = 0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
        if self.free > self.total:
            raise ValueError(f"free must be at most total={self.total}, got {self.free}")
        if self.allocated > self.reserved:
            raise ValueError(f"allocated must be at most reserved={self.reserved}, got {self.allocated}")

    @property
    def used(self) -> int:
        """``total - free``: the device's used memory, ``nvidia-smi``'s "Memory-Usage" (all processes)."""
        return self.total - self.free

    @property
    def cached(self) -> int:
        """``reserved - allocated``: held by the allocator, not by any tensor."""
        return self.reserved - self.allocated

    @property
    def outside_allocator(self) -> int:
        """``used - reserved``: the CUDA context, loaded kernels' code, and other processes."""
        return self.used - self.reserved


def read(device: torch.device | str | int | None = None) -> Reading | NotOnCUDA:
    """The allocator's and the driver's figures for ``device`` now.

    Example:
        >>> reading = read()
        >>> reading.cached if reading else reading.reason  # doctest: +SKIP
    """
    missing = _not_on_cuda(device)
    if missing is not None:
        return missing
    device = _device(device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return Reading(allocated=torch.cuda.memory_allocated(device),
                   reserved=torch.cuda.memory_reserved(device), free=int(free), total=int(total),
                   peak_allocated=torch.cuda.max_memory_allocated(device),
                   peak_reserved=torch.cuda.max_memory_reserved(device))


# --------------------------------------------------------------------------- nvidia-smi

#: What :func:`smi_reading` asks ``nvidia-smi`` for, in MiB.
SMI_QUERY = "memory.total,memory.used,memory.free"


@dataclass(frozen=True)
class SmiReading:
    """``nvidia-smi``'s figures for one card, in bytes (it reports MiB: MiB x 2**20)."""

    total: int
    used: int
    free: int


def _parse_smi(output: str) -> SmiReading:
    """``nvidia-smi``'s ``"15360, 1234, 14126"`` (total, used, free MiB) as a SmiReading."""
    text("output", output)
    line = output.strip().splitlines()[0] if output.strip() else ""
    try:
        total, used, free = (int(x.strip()) for x in line.split(","))
    except ValueError:
        raise ValueError(f"output must start with a line of three integers (MiB) separated by "
                         f"commas, got {output!r}") from None
    if min(total, used, free) < 0:
        raise ValueError(f"output must hold non-negative MiB, got {output!r}")
    return SmiReading(total * MiB, used * MiB, free * MiB)


def smi_reading(device: torch.device | str | int | None = None, *,
                timeout: float = 30) -> SmiReading | NotOnCUDA:
    """What ``nvidia-smi`` shows for the card of ``device`` now: the figure learners see first.

    The card is named by its UUID where PyTorch reports one (so that ``CUDA_VISIBLE_DEVICES``
    cannot make ``nvidia-smi`` read another card), else by its index.

    Args:
        device (torch.device or str or int, optional): a CUDA device; None means the current one.
        timeout (float): seconds to wait for ``nvidia-smi`` (a finite number > 0, at most
            :data:`MAX_PROBE_SECONDS`).

    Returns:
        A :class:`SmiReading`, or a :class:`NotOnCUDA` without CUDA or when ``nvidia-smi``
        cannot be run (its ``reason`` says which).

    Raises:
        ValueError: naming ``device`` or ``timeout``, for a bad value.
    """
    number("timeout", timeout, above=0.0, maximum=MAX_PROBE_SECONDS)
    missing = _not_on_cuda(device)
    if missing is not None:
        return missing
    dev = _device(device)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    card = f"GPU-{uuid}" if uuid is not None else str(index)
    try:
        done = subprocess.run(["nvidia-smi", f"--id={card}", f"--query-gpu={SMI_QUERY}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=timeout, check=True)
        return _parse_smi(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return NotOnCUDA(f"no nvidia-smi: it could not be read here ({type(exc).__name__})")


# --------------------------------------------------------------------------- one step

@dataclass(frozen=True)
class StepReport:
    """A training step's memory as the engine counts it and as the allocator and driver see it."""

    predicted: int
    resident: int
    before: Reading
    after: Reading

    def __post_init__(self):
        fields(self, predicted=int, resident=int, before=Reading, after=Reading)

    @property
    def measured(self) -> int:
        """What the prediction is compared with: ``resident`` plus the step's own peak
        (``max_memory_allocated`` minus what was allocated before the step)."""
        return self.resident + self.after.peak_allocated - self.before.allocated

    def rows(self) -> list[tuple[str, int]]:
        """``(what, bytes)`` from the prediction to what ``nvidia-smi`` shows, one layer at a
        time."""
        return [
            ("predicted: the step's tensors, model states included", self.predicted),
            ("measured: model states + the step's max_memory_allocated", self.measured),
            ("max_memory_allocated (+ earlier cells' tensors, cuBLAS)", self.after.peak_allocated),
            ("max_memory_reserved (+ blocks the allocator caches)", self.after.peak_reserved),
            ("memory_reserved after the step (cached blocks stay)", self.after.reserved),
            ("used on the device as nvidia-smi shows it (+ CUDA context)", self.after.used),
        ]

    def table(self) -> str:
        """:meth:`rows` as aligned text, binary units with exact bytes beside them (under 100
        characters a line)."""
        return "\n".join(f"{what:60s} {format_bytes(n):>11s} {n:>15,d} B" for what, n in self.rows())


def step_report(fn: Callable[[], object], *, predicted: int, resident: int,
                device: torch.device | str | int | None = None) -> StepReport | NotOnCUDA:
    """Run one training step ``fn()`` and set the engine's prediction beside the allocator's books.

    Run a step first (AdamW creates its state in it), so that this one is a steady-state step.

    Args:
        fn (callable): the step, a callable without arguments.
        predicted (int): the engine's peak bytes for it (``predict(step).total``).
        resident (int): bytes of the model states before the step
            (``course_lib.measurement.memory.resident_bytes``).
        device (torch.device or str or int, optional): the CUDA device it runs on; None means the
            current one.

    Returns:
        A :class:`StepReport`, or a :class:`NotOnCUDA` without CUDA (``fn`` is not run).

    Raises:
        ValueError: if ``fn`` is not callable or ``predicted``/``resident`` are not
            non-negative ints.

    Example:
        >>> report = step_report(one_step, predicted=fit_.peak_bytes,  # doctest: +SKIP
        ...                      resident=measure.resident_bytes(model, optimizer))
        >>> print(report.table() if report else report.reason)  # doctest: +SKIP
    """
    if not callable(fn):
        raise WrongTypeError(f"fn must be callable with no arguments, got {fn!r}")
    _device(device)
    for name, value in (("predicted", predicted), ("resident", resident)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
    missing = _not_on_cuda(device)
    if missing is not None:
        return missing
    device = _device(device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = read(device)
    fn()
    return StepReport(predicted, resident, before, read(device))


# --------------------------------------------------------------------------- a fresh process

def _parse_alloc_conf(value: str | None) -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF``'s ``"key:value,key:value"`` as a dict (empty for None or "")."""
    if value is None:
        return {}
    if not isinstance(value, str):
        raise WrongTypeError(f"value must be a str or None, got {value!r}")
    options = {}
    for entry in filter(str.strip, value.split(",")):
        key, sep, setting = entry.partition(":")
        if not sep or not key.strip():
            raise ValueError(f"{ALLOC_CONF} entries must be key:value, got {entry!r} in {value!r}")
        options[key.strip()] = setting.strip()
    return options


def _alloc_conf_env(env: Mapping[str, str], expandable_segments: bool) -> dict[str, str]:
    """A copy of ``env`` in which the allocator's options turn expandable segments on or off."""
    boolean("expandable_segments", expandable_segments)
    _check_env(env)
    env = dict(env)
    for name in [n for n in ALLOC_CONF_VARS if n in env] or [ALLOC_CONF]:
        options = _parse_alloc_conf(env[name] if name in env else None)
        options["expandable_segments"] = str(bool(expandable_segments))
        env[name] = ",".join(f"{k}:{v}" for k, v in options.items())
    return env


def _check_env(env) -> None:
    if not isinstance(env, Mapping):
        raise WrongTypeError(f"env must be a mapping of environment variables (os.environ), got "
                         f"{type(env).__name__}")


def _expandable_segments_enabled(env: Mapping[str, str]) -> bool:
    """Whether ``env`` turns expandable segments on (the first of :data:`ALLOC_CONF_VARS` it sets
    decides, as in PyTorch 2.8 and later)."""
    _check_env(env)
    for name in ALLOC_CONF_VARS:
        if name in env:
            return _parse_alloc_conf(env[name]).get("expandable_segments", "").lower() == "true"
    return False


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` measured in a fresh process, stage by stage."""

    expandable_segments: bool
    free_before_init: int
    stages: tuple[tuple[str, Reading], ...]

    def stage(self, name: str) -> Reading:
        """The :class:`Reading` of stage ``name``."""
        text("name", name)
        for stage, reading in self.stages:
            if stage == name:
                return reading
        raise ValueError(f"name must be one of {[s for s, _ in self.stages]}, got {name!r}")

    def process_bytes(self, reading: Reading) -> int:
        """What the process occupies on the device at ``reading``, as ``nvidia-smi`` lists it:
        ``free_before_init - reading.free``."""
        _check_reading(reading)
        return self.free_before_init - reading.free

    @property
    def context(self) -> int:
        """The CUDA context: bytes the process took when CUDA initialised, beyond its allocator's."""
        return _context_bytes(self.free_before_init, self.stage("CUDA initialised"))

    @property
    def cublas_workspace(self) -> int:
        """Bytes the first matmul left allocated once its tensors were freed: cuBLAS' workspace."""
        return (self.stage("first matmul").allocated
                - self.stage("CUDA initialised").allocated)

    @property
    def library_code(self) -> int:
        """Bytes outside the allocator that the first matmul added: cuBLAS' kernels, loaded lazily."""
        return (_context_bytes(self.free_before_init, self.stage("first matmul"))
                - self.context)

    @property
    def fragmentation(self) -> int:
        """Reserved minus allocated after the growing requests: cached, but no tensor uses it."""
        return self.stage("growing requests").cached

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        """``(stage, allocated, reserved, process on the device, outside the allocator)`` per
        stage."""
        return [(name, r.allocated, r.reserved, self.process_bytes(r),
                 self.process_bytes(r) - r.reserved) for name, r in self.stages]

    def table(self) -> str:
        """:meth:`rows` as aligned text in binary units."""
        head = (f"{'stage':18s} {'allocated':>11s} {'reserved':>11s} {'process (smi)':>14s} "
                f"{'outside alloc.':>14s}")
        lines = [head] + [f"{name:18s} " + " ".join(f"{format_bytes(n):>{w}s}" for n, w in
                                                    zip(values, (11, 11, 14, 14)))
                          for name, *values in self.rows()]
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: Mapping) -> Probe:
        """The :class:`Probe` of the JSON object the probing process prints."""
        try:
            stages = tuple((str(name), Reading(**reading)) for name, reading in data["stages"])
            return cls(bool(data["expandable_segments"]), int(data["free_before_init"]), stages)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"data must be a probe's JSON object, got {data!r}") from exc


def _check_reading(reading) -> None:
    if not isinstance(reading, Reading):
        raise WrongTypeError(f"reading must be a course_lib.measurement.allocator.Reading, got "
                         f"{type(reading).__name__}")


def _context_bytes(free_before_init: int, reading: Reading) -> int:
    """Bytes held outside the allocator: free bytes taken since before CUDA init, minus reserved."""
    if not isinstance(free_before_init, int) or isinstance(free_before_init, bool) \
            or free_before_init < 0:
        raise ValueError(f"free_before_init must be a non-negative int of bytes, "
                         f"got {free_before_init!r}")
    _check_reading(reading)
    return free_before_init - reading.free - reading.reserved


def probe(expandable_segments: bool = False, *, device: int = 0,
          sizes_mib: Sequence[int] = FRAGMENTING_SIZES_MIB,
          timeout: float = 300) -> Probe | NotOnCUDA:
    """Measure the CUDA context, the cuBLAS workspace and fragmentation in a fresh process.

    The process starts with ``PYTORCH_CUDA_ALLOC_CONF`` set by :func:`_alloc_conf_env`
    (read once, when CUDA initialises: that is why it is a new process), reads the
    device after initialising CUDA, after a first 512 x 512 matmul whose tensors it then
    frees, after requesting buffers of ``sizes_mib`` one after the other (each freed
    before the next, the last kept), and after ``torch.cuda.empty_cache()``. The
    device's free bytes are read here just before it starts, so this process must not
    allocate meanwhile (it waits for the child).

    Args:
        expandable_segments (bool): run the process with ``expandable_segments:True``.
        device (int): the CUDA device index.
        sizes_mib (sequence of int): the growing requests, in MiB (positive ints, at most
            :data:`MAX_PROBE_MIB`).
        timeout (float): seconds to wait for the process (a finite number > 0, at most
            :data:`MAX_PROBE_SECONDS`).

    Returns:
        A :class:`Probe`, or a :class:`NotOnCUDA` without CUDA.

    Raises:
        ValueError: for a bad argument.
        RuntimeError: if the process fails (its error output is in the message).

    Example:
        >>> default, expandable = probe(False), probe(True)  # doctest: +SKIP
        >>> expandable.fragmentation < default.fragmentation  # doctest: +SKIP
        True
    """
    boolean("expandable_segments", expandable_segments)
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise ValueError(f"device must be a CUDA device index (an int >= 0), got {device!r}")
    sizes = _check_sizes(sizes_mib)
    number("timeout", timeout, above=0.0, maximum=MAX_PROBE_SECONDS)
    missing = _not_on_cuda(device)
    if missing is not None:
        return missing
    free_before, _ = torch.cuda.mem_get_info(device)
    command = [sys.executable, "-m", "course_lib.measurement.allocator", "--free-before-init", str(int(free_before)),
               "--device", str(device), "--sizes-mib", ",".join(map(str, sizes))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=_alloc_conf_env(os.environ, expandable_segments))
    if done.returncode != 0:
        raise RuntimeError(f"the probing process failed ({done.returncode}): {done.stderr.strip()}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    if not data.get("available", False):
        return NotOnCUDA(data.get("reason", "not on CUDA"))
    return Probe.from_dict(data)


def _check_sizes(sizes_mib) -> tuple[int, ...]:
    if (isinstance(sizes_mib, str) or not isinstance(sizes_mib, Sequence) or not sizes_mib
            or len(sizes_mib) > 1024 or any(not isinstance(s, int) or isinstance(s, bool)
                                            or not 1 <= s <= MAX_PROBE_MIB for s in sizes_mib)):
        raise ValueError(f"sizes_mib must be a non-empty sequence of at most 1024 positive ints "
                         f"of at most {MAX_PROBE_MIB:,} (MiB), got {sizes_mib!r}")
    return tuple(sizes_mib)


def _measure(free_before_init: int, device: int, sizes_mib: Sequence[int]) -> dict:
    """The probing process's work (see :func:`probe`); returns its JSON object."""
    missing = _not_on_cuda(device)
    if missing is not None:
        return {"available": False, "reason": missing.reason}
    dev = torch.device("cuda", device)
    stages = []

    def stage(name):
        reading = read(dev)
        stages.append((name, asdict(reading)))

    torch.cuda.init()
    torch.cuda.mem_get_info(dev)  # creates the device's context
    stage("CUDA initialised")
    a = torch.ones(512, 512, device=dev)
    b = a @ a  # cuBLAS: its kernels load, its handle gets a workspace from the allocator
    torch.cuda.synchronize(dev)
    del a, b
    stage("first matmul")
    buffer = None
    for mib in sizes_mib:  # each request a little larger than the cached block the last one freed
        buffer = None
        buffer = torch.empty(mib * MiB, dtype=torch.uint8, device=dev)
    stage("growing requests")
    del buffer
    torch.cuda.empty_cache()
    stage("empty_cache")
    return {"available": True, "free_before_init": free_before_init,
            "expandable_segments": _expandable_segments_enabled(os.environ), "stages": stages}


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure the CUDA context, the cuBLAS workspace "
                                     "and fragmentation in this fresh process; print JSON.")
    parser.add_argument("--free-before-init", type=int, required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--sizes-mib", default=",".join(map(str, FRAGMENTING_SIZES_MIB)))
    args = parser.parse_args(argv)
    sizes = _check_sizes([int(s) for s in args.sizes_mib.split(",")])
    print(json.dumps(_measure(args.free_before_init, args.device, sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
