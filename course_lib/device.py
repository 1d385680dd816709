"""Which device and which training dtype this kernel should use.

The same notebook runs on a laptop CPU, on Apple silicon (MPS), on Colab's T4 and
on datacenter GPUs. :func:`pick_device` prefers CUDA, then MPS, then the CPU;
:func:`pick_dtype` chooses the 16-bit format for mixed precision:

* CUDA with native bf16 (Ampere and newer: A100, H100, L4): ``torch.bfloat16``.
  bf16 has fp32's exponent range, so no loss scaling is needed.
* CUDA without native bf16 (Turing, e.g. Colab's T4): ``torch.float16`` with a
  ``torch.amp.GradScaler``: fp16's 5-bit exponent underflows small gradients
  unless the loss is scaled up first (Micikevicius et al. 2018, "Mixed Precision
  Training").
* CPU: ``torch.float32``. CPU autocast exists, but the course's CPU runs are there
  to be quick and exact, not to imitate a GPU.
* MPS: ``torch.bfloat16`` where the OS supports it, else ``torch.float16``.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

import torch

from .units import format_bytes

_KINDS = ("cuda", "mps", "cpu")


def in_colab() -> bool:
    """True when running inside Google Colab (its ``google.colab`` module is loaded)."""
    return "google.colab" in sys.modules


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(prefer: str | None = None) -> torch.device:
    """The best available device: CUDA > MPS > CPU, or ``prefer`` if it is available.

    ``prefer`` is one of "cuda", "mps", "cpu" or None; asking for a device that
    this machine lacks raises ``ValueError`` rather than silently falling back.
    """
    if prefer is not None:
        if prefer not in _KINDS:
            raise ValueError(f"prefer must be one of {_KINDS} or None, got {prefer!r}")
        available = {"cuda": torch.cuda.is_available(), "mps": _mps_available(), "cpu": True}
        if not available[prefer]:
            raise ValueError(f"prefer={prefer!r} but this machine has no {prefer} device")
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def cuda_has_native_bf16(device: torch.device | str = "cuda") -> bool:
    """True on GPUs with bf16 tensor cores (compute capability 8.0+); False on a T4 (7.5)."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    return major >= 8


def pick_dtype(device: torch.device | str) -> torch.dtype:
    """The training dtype for ``device``: bf16 or fp16 on GPUs, fp32 on the CPU (see module doc)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if cuda_has_native_bf16(device) else torch.float16
    if device.type == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device)
            return torch.bfloat16
        except (RuntimeError, TypeError):
            return torch.float16
    if device.type == "cpu":
        return torch.float32
    raise ValueError(f"device must be a cuda, mps or cpu device, got {device}")


def needs_grad_scaler(dtype: torch.dtype) -> bool:
    """fp16 training needs loss scaling; bf16 and fp32 do not."""
    return dtype == torch.float16


@dataclass(frozen=True)
class DeviceInfo:
    """What :func:`describe` found: the device, its dtype and its memory in bytes."""

    device: torch.device
    dtype: torch.dtype
    grad_scaler: bool
    name: str
    total_memory: int | None
    in_colab: bool
    torch_version: str

    def summary(self) -> str:
        mem = format_bytes(self.total_memory) if self.total_memory else "n/a (host memory)"
        dtype = str(self.dtype).replace("torch.", "")
        scaler = " with GradScaler" if self.grad_scaler else ""
        lines = [
            f"device        : {self.device} ({self.name})",
            f"device memory : {mem}",
            f"training dtype: {dtype}{scaler}",
            f"torch         : {self.torch_version}",
            f"python        : {platform.python_version()}",
            f"running in    : {'Google Colab' if self.in_colab else 'local Jupyter / Python'}",
        ]
        return "\n".join(lines)


def describe(device: torch.device | str | None = None) -> DeviceInfo:
    """A :class:`DeviceInfo` for ``device`` (default: :func:`pick_device`)."""
    device = pick_device() if device is None else torch.device(device)
    dtype = pick_dtype(device)
    total = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, int(props.total_memory)
    elif device.type == "mps":
        name = "Apple GPU (MPS)"
    else:
        name = platform.processor() or platform.machine() or "CPU"
    return DeviceInfo(
        device=device,
        dtype=dtype,
        grad_scaler=needs_grad_scaler(dtype),
        name=name,
        total_memory=total,
        in_colab=in_colab(),
        torch_version=torch.__version__,
    )


def print_summary(device: torch.device | str | None = None) -> DeviceInfo:
    """Print the one-screen summary of :func:`describe` and return the info."""
    info = describe(device)
    print(info.summary())
    return info
