"""Byte counts: exact integers in code, binary units (KiB, MiB, GiB) on screen.

Every function in the course returns memory in **bytes** as an ``int``. Vendors
quote GPU memory in decimal gigabytes (an "80 GB" H100 has 80 * 10**9 bytes on
the box, 79.1 GiB reported by the driver); the course prints binary units and
says so.
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
    """``torch.float32`` or one of its names (``"fp32"``, ``"bf16"``, ...) as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (fp32: 4, bf16/fp16: 2, int8/bool: 1).

    Args:
        dtype (torch.dtype or str): a dtype or a name :func:`as_dtype` takes.

    Returns:
        The bytes per element, an int (``dtype.itemsize``).

    Raises:
        ValueError: naming ``dtype``, as :func:`as_dtype` does.
    """
    return as_dtype(dtype).itemsize


def tensor_bytes(shape, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of a dense tensor: ``prod(shape) * dtype_bytes(dtype)``.

    Args:
        shape: a sequence of ints >= 0 (a ``torch.Size``, a tuple, a list); no bool or float.
        dtype (torch.dtype or str): a ``torch.dtype`` or one of its names (``"bf16"``).

    Returns:
        The bytes, an int.

    Raises:
        ValueError: naming ``shape`` or ``dtype``, for a bad value.

    Example:
        >>> tensor_bytes((2, 3), "fp32")
        24
    """
    if (isinstance(shape, str | bytes | dict) or not hasattr(shape, "__iter__")
            or getattr(shape, "ndim", None) == 0):  # a 0-d array or tensor does not iterate
        raise ValueError(f"shape must be a sequence of ints, got {shape!r}")
    dims = [integer("shape", d, minimum=0, maximum=2**63 - 1) for d in shape]
    n = 1
    for d in dims:
        n *= d
    return n * dtype_bytes(dtype)


def storage_key(tensor: torch.Tensor | torch.UntypedStorage) -> int:
    """The identity of the storage ``tensor`` lives in: equal for every view of one storage.

    It is the address of PyTorch's C++ storage object (``untyped_storage()._cdata``, the number
    PyTorch's own ``torch.multiprocessing.reductions.StorageWeakRef`` hashes). The storage's
    data pointer cannot serve: on the ``meta`` device it is 0 for every storage, an empty
    storage has 0 on every device, and a CPU and a CUDA storage may have equal addresses.
    Keys are distinct among storages alive at the same time (a freed storage's address may be
    reused), so keep the tensors while their keys are compared.

    Args:
        tensor (torch.Tensor or torch.UntypedStorage): a ``torch.Tensor`` with a storage (strided:
            not sparse), on any device, or a ``torch.UntypedStorage`` (its own key).

    Returns:
        An int.

    Raises:
        ValueError: naming ``tensor``, for a non-tensor or a tensor without a storage.

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
    """Bytes of the distinct storages that ``tensors`` live in: each storage once, whole.

    ``sum(untyped_storage().nbytes())`` over the distinct :func:`storage_key` s. Views of one
    storage count once, and at the size of the whole storage (what it holds in memory, also
    when the views cover only part of it). On the ``meta`` device storages have a size and no
    memory: they are counted at that size, each one, which is how a 70B model's states are
    "measured" without allocating them. ``block`` rounds each storage up to a multiple of
    ``block`` bytes (512: what the CUDA caching allocator hands out,
    :data:`course_lib.model.kernels.CUDA_BLOCK`).

    Args:
        tensors: an iterable of tensors with storages (a generator is fine).
        block (int): bytes, an int from 1 to :data:`course_lib.validation.MAX_BYTES`.

    Returns:
        Bytes, an int.

    Raises:
        ValueError: naming ``tensors`` (not an iterable of tensors with storages) or
            ``block``.

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
    """``1536`` -> ``"1.50 KiB"``: binary units, as PyTorch's memory summaries use.

    Units are GiB (2**30), MiB (2**20) and KiB (2**10) bytes; below 1 KiB the bytes are printed
    whole (``"512 B"``). Negative numbers keep their sign.

    Args:
        n (int or float): bytes, a finite number (not a bool).
        precision (int): digits after the point, an int from 0 to 12.

    Returns:
        str: the size, such as ``"1.50 KiB"``.

    Raises:
        ValueError: naming the parameter, for a bad value.

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
