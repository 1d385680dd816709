"""Byte counts: exact integers in code, binary units (KiB, MiB, GiB) on screen.

Every function in the course returns memory in **bytes** as an ``int``. Vendors
quote GPU memory in decimal gigabytes (an "80 GB" H100 has 80 * 10**9 bytes on
the box, 79.1 GiB reported by the driver); the course prints binary units and
says so.
"""

from __future__ import annotations

import torch

from .validation import integer, number

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "int8": torch.int8,
    "bool": torch.bool,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or one of its names ("fp32", "bf16", ...) as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (fp32: 4, bf16/fp16: 2, int8/bool: 1)."""
    return as_dtype(dtype).itemsize


def tensor_bytes(shape, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of a dense tensor: ``prod(shape) * dtype_bytes(dtype)``.

    Args:
        shape: a sequence of ints >= 0 (a ``torch.Size``, a tuple, a list); no bool or float.
        dtype: a ``torch.dtype`` or one of its names (``"bf16"``).

    Returns:
        The bytes, an int.

    Raises:
        ValueError: naming ``shape`` or ``dtype``, for a bad value.

    Example::

        tensor_bytes((2, 3), "fp32")  # 24
    """
    if isinstance(shape, str | bytes | dict) or not hasattr(shape, "__iter__"):
        raise ValueError(f"shape must be a sequence of ints, got {shape!r}")
    dims = [integer("shape", d, minimum=0, maximum=2**63 - 1) for d in shape]
    n = 1
    for d in dims:
        n *= d
    return n * dtype_bytes(dtype)


def format_bytes(n: int | float, precision: int = 2) -> str:
    """``1536`` -> ``"1.50 KiB"``: binary units, as PyTorch's memory summaries use.

    Args:
        n: bytes, a finite number (not a bool).
        precision: digits after the point, an int from 0 to 12.

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not isinstance(n, int) or isinstance(n, bool):
        n = number("n", n)
    integer("precision", precision, minimum=0, maximum=12)
    if n < 0:
        return "-" + format_bytes(-n, precision)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.{precision}f} {unit}"
    return f"{int(n)} B"
