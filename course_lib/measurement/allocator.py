"""06: what ``nvidia-smi`` shows beyond ``torch.cuda.max_memory_allocated`` on a CUDA device:
cached blocks, the CUDA context, cuBLAS' workspace, fragmentation (PyTorch's "CUDA semantics").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from course_lib import validation
from course_lib.units import MiB, format_bytes
from course_lib.validation import boolean, integer, items, number

#: The largest request :func:`probe` makes, in MiB (1 TiB), and the longest it waits, in seconds.
MAX_PROBE_MIB = 2**20
MAX_PROBE_SECONDS = 86_400.0

#: The allocator's options variable; torch 2.8 and later read ``PYTORCH_ALLOC_CONF`` first.
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: The growing requests (MiB) :func:`probe` makes to fragment the cache, as varying batches do.
FRAGMENTING_SIZES_MIB = (32, 36, 40, 44, 48, 52, 56, 60)


@dataclass(frozen=True)
class _NotOnCUDA:
    """The falsy result of a measurement that needs CUDA; its ``reason`` (its ``str``) says why."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason


def _not_on_cuda(device: torch.device | str | int | None = None) -> _NotOnCUDA | None:
    """None if ``device`` is a usable CUDA device, else the :class:`_NotOnCUDA` saying why."""
    device = _device(device)
    if device.type != "cuda":
        return _NotOnCUDA(f"not on CUDA: the device is {device.type}, where there is no CUDA "
                          "caching allocator, CUDA context or cuBLAS workspace to measure")
    if not torch.cuda.is_available():
        return _NotOnCUDA("not on CUDA: this machine has no CUDA device, so there is no CUDA "
                          "caching allocator, CUDA context or cuBLAS workspace to measure")
    return None


def _device(device) -> torch.device:
    """``device`` as a torch.device: None is the current CUDA device, an int a CUDA index."""
    if device is None:
        return torch.device("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", integer("device", device, minimum=0, maximum=1023))
    return validation.device("device", device)


@dataclass(frozen=True)
class _Reading:
    """The allocator's and the driver's figures, in bytes (``torch.cuda`` memory stats)."""

    allocated: int
    reserved: int
    free: int
    total: int
    peak_allocated: int = 0
    peak_reserved: int = 0

    @property
    def cached(self) -> int:
        """``reserved - allocated``: held by the allocator, not by any tensor."""
        return self.reserved - self.allocated


def _read(device: torch.device | str | int | None = None) -> _Reading | _NotOnCUDA:
    """The allocator's and the driver's figures for ``device`` now."""
    if (missing := _not_on_cuda(device)) is not None:
        return missing
    device = _device(device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return _Reading(allocated=torch.cuda.memory_allocated(device),
                    reserved=torch.cuda.memory_reserved(device), free=int(free), total=int(total),
                    peak_allocated=torch.cuda.max_memory_allocated(device),
                    peak_reserved=torch.cuda.max_memory_reserved(device))


def _parse_alloc_conf(value: str) -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF``'s ``"key:value,key:value"`` as a dict."""
    options = {}
    for entry in filter(str.strip, value.split(",")):
        key, sep, setting = entry.partition(":")
        if not sep or not key.strip():
            raise ValueError(f"{ALLOC_CONF} entries must be key:value, got {entry!r} in {value!r}")
        options[key.strip()] = setting.strip()
    return options


def _alloc_conf_env(env: Mapping[str, str], expandable_segments: bool) -> dict[str, str]:
    """A copy of ``env`` in which the allocator's options turn expandable segments on or off."""
    env = dict(env)
    for name in [n for n in ALLOC_CONF_VARS if n in env] or [ALLOC_CONF]:
        options = _parse_alloc_conf(env.get(name, ""))
        options["expandable_segments"] = str(bool(expandable_segments))
        env[name] = ",".join(f"{k}:{v}" for k, v in options.items())
    return env


def _expandable_segments_enabled(env: Mapping[str, str]) -> bool:
    """Whether ``env`` turns expandable segments on (the first of ``ALLOC_CONF_VARS`` decides)."""
    for name in ALLOC_CONF_VARS:
        if name in env:
            return _parse_alloc_conf(env[name]).get("expandable_segments", "").lower() == "true"
    return False


@dataclass(frozen=True)
class _Probe:
    """What :func:`probe` measured in a fresh process, stage by stage."""

    expandable_segments: bool
    free_before_init: int
    stages: tuple[tuple[str, _Reading], ...]

    def stage(self, name: str) -> _Reading:
        """The reading of stage ``name``."""
        for stage, reading in self.stages:
            if stage == name:
                return reading
        raise ValueError(f"name must be one of {[s for s, _ in self.stages]}, got {name!r}")

    def process_bytes(self, reading: _Reading) -> int:
        """The process's bytes on the device, as ``nvidia-smi`` lists it."""
        return self.free_before_init - reading.free

    @property
    def context(self) -> int:
        """The CUDA context: bytes taken when CUDA initialised, beyond the allocator's."""
        first = self.stage("CUDA initialised")
        return self.process_bytes(first) - first.reserved

    @property
    def cublas_workspace(self) -> int:
        """Bytes the first matmul left allocated once its tensors were freed: cuBLAS' workspace."""
        return self.stage("first matmul").allocated - self.stage("CUDA initialised").allocated

    @property
    def library_code(self) -> int:
        """Bytes outside the allocator the first matmul added: cuBLAS' kernels, loaded lazily."""
        matmul = self.stage("first matmul")
        return self.process_bytes(matmul) - matmul.reserved - self.context

    @property
    def fragmentation(self) -> int:
        """Reserved minus allocated after the growing requests: cached, but no tensor uses it."""
        return self.stage("growing requests").cached

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        """``(stage, allocated, reserved, process on the device, outside the allocator)``."""
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
    def from_dict(cls, data: Mapping) -> _Probe:
        """The probe of the JSON object the probing process prints."""
        stages = tuple((str(name), _Reading(**reading)) for name, reading in data["stages"])
        return cls(bool(data["expandable_segments"]), int(data["free_before_init"]), stages)


def probe(expandable_segments: bool = False, *, device: int = 0,
          sizes_mib: Sequence[int] = FRAGMENTING_SIZES_MIB,
          timeout: float = 300) -> _Probe | _NotOnCUDA:
    """Measure the CUDA context, cuBLAS' workspace and fragmentation in a fresh process (the
    allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once): after CUDA init, a first matmul, growing
    requests of ``sizes_mib`` and ``empty_cache()``. Without CUDA, a falsy result.
    Args:
        expandable_segments (bool): the allocator option the fresh process runs with.
        device (int): the CUDA device's index.
        sizes_mib (sequence of int): the growing requests, in MiB.
        timeout (float): seconds to wait for the process.
    Returns:
        the probe (``context``, ``cublas_workspace``, ``fragmentation``, ``table()``).
    Raises:
        ValueError: naming the argument, for a value out of range.
        RuntimeError: if the probing process fails.
    """
    boolean("expandable_segments", expandable_segments)
    device = integer("device", device, minimum=0)
    sizes = [integer("sizes_mib", s, minimum=1, maximum=MAX_PROBE_MIB)
             for s in items("sizes_mib", sizes_mib, min_len=1, max_len=1024)]
    number("timeout", timeout, above=0.0, maximum=MAX_PROBE_SECONDS)
    if (missing := _not_on_cuda(device)) is not None:
        return missing
    # Read before the child starts: this process must not allocate meanwhile (it waits).
    free_before, _ = torch.cuda.mem_get_info(device)
    code = ("import json, sys; from course_lib.measurement.allocator import _measure; "
            "print(json.dumps(_measure(*json.loads(sys.argv[1]))))")
    command = [sys.executable, "-c", code, json.dumps([int(free_before), device, sizes])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=_alloc_conf_env(os.environ, expandable_segments))
    if done.returncode != 0:
        raise RuntimeError(f"the probing process failed ({done.returncode}): {done.stderr.strip()}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    if not data.get("available", False):
        return _NotOnCUDA(data.get("reason", "not on CUDA"))
    return _Probe.from_dict(data)


def _measure(free_before_init: int, device: int, sizes_mib: Sequence[int]) -> dict:
    """The probing process's work (see :func:`probe`); returns its JSON object."""
    if (missing := _not_on_cuda(device)) is not None:
        return {"available": False, "reason": missing.reason}
    dev = torch.device("cuda", device)
    stages = []

    def stage(name):
        stages.append((name, asdict(_read(dev))))

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
