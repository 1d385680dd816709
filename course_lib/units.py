"""Byte counts: exact ``int`` bytes in code, binary units (KiB, MiB, GiB) on screen.

Vendors quote GPU memory in decimal gigabytes (an "80 GB" H100 reports 79.1 GiB); the course
prints binary units and says so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .validation import MAX_BYTES, WrongTypeError, integer, number, positive_int

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9


class _Category(NamedTuple):
    label: str   # what learners read in tables and legends
    colour: str  # its colour in every figure


#: The six categories of a step's memory, bottom to top as figures stack them: field name (of
#: :class:`course_lib.prediction.engine.StepMemory`, and of
#: :class:`course_lib.prediction.formulas.TrainingMemory` for the first four) -> label, colour.
MEMORY_CATEGORIES = {
    "parameters": _Category("parameters", "#4c72b0"),
    "master_weights": _Category("master weights", "#64b5cd"),
    "optimizer_state": _Category("optimizer state", "#8172b2"),
    "gradients": _Category("gradients", "#55a868"),
    "activations": _Category("activations", "#dd8452"),
    "transient": _Category("in flight", "#c44e52"),  # gradients passed between ops, scratch
}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp64": torch.float64, "float64": torch.float64, "int8": torch.int8, "bool": torch.bool}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or one of its names (``"fp32"``, ``"bf16"``, ...) as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` or of a name :func:`as_dtype` takes (fp32: 4, bf16: 2)."""
    return as_dtype(dtype).itemsize


def storage_key(tensor: torch.Tensor | torch.UntypedStorage) -> int:
    """The identity of the storage ``tensor`` lives in: equal for every view of one storage.

    The address of PyTorch's C++ storage object (``untyped_storage()._cdata``, what
    ``torch.multiprocessing.reductions.StorageWeakRef`` hashes); the data pointer cannot serve (0
    for every ``meta`` and every empty storage). A freed storage's key may be reused: keep the
    tensors while their keys are compared.

    Args:
        tensor (torch.Tensor or torch.UntypedStorage): a strided tensor on any device, or a storage.

    Returns:
        int: the key.
    Raises:
        ValueError: for a ``tensor`` without a storage (sparse, nested).

    Example:
        >>> x = torch.zeros(4, 4)
        >>> storage_key(x[1:]) == storage_key(x.t())  # views of one storage
        True
    """
    if isinstance(tensor, torch.UntypedStorage):
        return tensor._cdata
    if not isinstance(tensor, torch.Tensor):
        raise WrongTypeError(f"tensor must be a torch.Tensor or a torch.UntypedStorage, got "
                             f"{type(tensor).__name__}")
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"tensor must have a storage (a strided tensor), got layout "
                         f"{tensor.layout}") from exc


def storage_bytes(tensors, *, block: int = 1) -> int:
    """Bytes of the distinct storages ``tensors`` live in: each storage once, whole.

    ``sum(untyped_storage().nbytes())`` over the distinct :func:`storage_key` s, each rounded up
    to a multiple of ``block`` (512: the CUDA caching allocator's block). ``meta`` storages count
    at their size, which is how a 70B model's states are "measured" without allocating them.

    Args:
        tensors: an iterable of strided tensors (a generator is fine).
        block (int): bytes, from 1 to :data:`course_lib.validation.MAX_BYTES`.

    Returns:
        int: the bytes.
    Raises:
        ValueError: for a ``block`` out of range, or ``tensors`` not an iterable of strided tensors.

    Example:
        >>> x = torch.zeros(10)  # 40 bytes
        >>> storage_bytes([x, x[2:], torch.zeros(3, dtype=torch.bfloat16)])
        46
        >>> storage_bytes([x], block=512)
        512
    """
    block = positive_int("block", block, maximum=MAX_BYTES)
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise ValueError(f"tensors must be an iterable of tensors, got {type(tensors).__name__}")
    storages = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise WrongTypeError(f"tensors must hold torch.Tensors, got {type(t).__name__}")
        try:
            key = storage_key(t)
        except ValueError as exc:
            raise ValueError(f"tensors must have storages (strided tensors), got layout "
                             f"{t.layout}") from exc
        storages[key] = t.untyped_storage().nbytes()
    return sum(-(-n // block) * block for n in storages.values())


def format_bytes(n: int | float, precision: int = 2) -> str:
    """``1536`` -> ``"1.50 KiB"``: GiB, MiB or KiB (2**30, 2**20, 2**10), as PyTorch's memory
    summaries print; below 1 KiB whole bytes (``"512 B"``); negative numbers keep their sign.

    Args:
        n (int or float): bytes, a finite number.
        precision (int): digits after the point, 0 to 12.

    Returns:
        str: the size.
    Raises:
        ValueError: for a non-finite ``n``, or a ``precision`` out of range.

    Example:
        >>> format_bytes(3 * GiB // 2)
        '1.50 GiB'
    """
    as_float = number("n", n)  # refuses ints beyond float's range too
    if not isinstance(n, int) or isinstance(n, bool):
        n = as_float
    precision = integer("precision", precision, minimum=0, maximum=12)
    if n < 0:
        return "-" + format_bytes(-n, precision)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.{precision}f} {unit}"
    return f"{int(n)} B"
