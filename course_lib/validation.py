"""Input checks shared by the public functions: a value of the wrong type raises
:class:`WrongTypeError`, a wrong value ``ValueError``, each naming the parameter.

No bool is an int, no float an int (not even ``2.0``: a size that came out of a division is a bug
to show), NaN and the infinities are no numbers; numpy's and 0-d tensors' integers count as
their ``int``. Sizes have a stated maximum, so that ``2**63`` is refused at once rather than
overflowing further down.
"""

from __future__ import annotations

import math
import numbers

#: The largest count any size parameter accepts unless a function states a smaller one.
MAX_COUNT = 2**40
#: The largest number of sequences in a batch, and of accumulation steps: 16M (GPT-3 trained on
#: batches of 1,600 sequences).
MAX_BATCH = 2**24
#: The largest memory size, in bytes, any budget or byte count accepts: 1 EiB.
MAX_BYTES = 2**60


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong type: a ``TypeError``, as PyTorch raises, and a ``ValueError``, so that
    a widget catching the course's ``ValueError`` still shows it (as numpy's ``AxisError``)."""


def _as_int(value) -> int | None:
    """``value`` as an ``int`` if it is an integer (a Python, numpy or 0-d torch integer, never
    a bool or a float, even a whole one); ``None`` otherwise."""
    if type(value) is int:  # the common case, first: predictions check thousands of shapes
        return value
    if hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()  # a numpy or torch integer scalar
        value = item if isinstance(item, int) and not isinstance(item, bool) else value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]``."""
    as_int = _as_int(value)
    if as_int is None:
        raise WrongTypeError(f"{name} must be an int, got {value!r}")
    value = as_int
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else f"{minimum:,}"
        high = "inf" if maximum is None else f"{maximum:,}"
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def positive_int(name: str, value, *, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) from 1 to ``maximum``."""
    as_int = _as_int(value)
    if as_int is None or as_int < 1 or (maximum is not None and as_int > maximum):
        bound = "" if maximum is None else f" of at most {maximum:,}"
        error = WrongTypeError if as_int is None else ValueError
        raise error(f"{name} must be a positive int{bound}, got {value!r}")
    return as_int


def number(name: str, value, *, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None, below: float | None = None) -> float:
    """``value`` as a ``float`` if it is a finite real number (not a bool) within the bounds
    (``minimum``/``maximum`` inclusive, ``above``/``below`` exclusive)."""
    if hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()  # a numpy or torch scalar
        value = item if isinstance(item, int | float) and not isinstance(item, bool) else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WrongTypeError(f"{name} must be a finite number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    for bound, ok, words in ((minimum, value >= (minimum or 0), ">="),
                             (maximum, value <= (maximum or 0), "<="),
                             (above, value > (above or 0), ">"),
                             (below, value < (below or 0), "<")):
        if bound is not None and not ok:
            raise ValueError(f"{name} must be a finite number {words} {bound}, got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    """``value`` if it is a ``bool`` (no truthiness: ``1`` and ``"yes"`` are refused)."""
    if not isinstance(value, bool):
        raise WrongTypeError(f"{name} must be True or False, got {value!r}")
    return value


def choice(name: str, value, options) -> str:
    """``value`` if it is a str and one of ``options``."""
    if not (isinstance(value, str) and value in options):
        error = ValueError if isinstance(value, str) else WrongTypeError
        raise error(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def device(name: str, value):
    """``torch.device(value)`` for a ``torch.device`` or a string naming one."""
    import torch

    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise WrongTypeError(f"{name} must be a torch.device or a device string such as 'cpu' or "
                             f"'cuda', got {value!r}")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{name} must be a device such as 'cpu', 'cuda', 'cuda:0' or 'mps', "
                         f"got {value!r}") from exc


def tensor(name: str, value, *, integral: bool = False, dim: int | None = None):
    """``value`` if it is a ``torch.Tensor`` of the expected kind."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise WrongTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if integral and (value.dtype.is_floating_point or value.dtype.is_complex
                     or value.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers (token ids), got dtype {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(value.shape)}")
    return value


def optional_positive_int(name: str, value, *, maximum: int | None = None) -> int | None:
    """``None``, or :func:`positive_int` of ``value``."""
    return None if value is None else positive_int(name, value, maximum=maximum)


def text(name: str, value) -> str:
    """``value`` if it is a ``str``."""
    if not isinstance(value, str):
        raise WrongTypeError(f"{name} must be a str, got {value!r}")
    return value


def function(name: str, value, *, optional: bool = False):
    """``value`` if it is callable (or ``None`` when ``optional``)."""
    if (value is None and optional) or callable(value):
        return value
    raise WrongTypeError(f"{name} must be callable{' or None' if optional else ''}, got {value!r}")


def items(name: str, value, *, min_len: int = 0, max_len: int = MAX_COUNT) -> list:
    """``list(value)`` for a list, tuple, range or other non-string sequence."""
    import collections.abc as abc

    if (isinstance(value, str | bytes | abc.Mapping | abc.Set)
            or not isinstance(value, abc.Sequence)):
        raise WrongTypeError(f"{name} must be a list or tuple, got {value!r}")
    if not min_len <= len(value) <= max_len:
        raise ValueError(f"{name} must hold {min_len:,} to {max_len:,} items, got "
                         f"{len(value):,}")
    return list(value)


def available_device(name: str, value):
    """:func:`device` of ``value``, if this machine has it: the CPU, the ``meta`` device, a CUDA
    device that ``torch.cuda`` counts, or MPS where it is available."""
    import torch

    dev = device(name, value)
    have = ["cpu", "meta"]
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have += ["cuda"] + [f"cuda:{i}" for i in range(cuda)] if cuda else []
    mps = getattr(torch.backends, "mps", None)
    have += ["mps"] if mps is not None and mps.is_available() else []
    ok = (dev.type in ("cpu", "meta") or (dev.type == "mps" and "mps" in have)
          or (dev.type == "cuda" and cuda and (dev.index is None or dev.index < cuda)))
    if not ok:
        missing = "no CUDA device" if dev.type == "cuda" and not cuda else f"no {dev}"
        raise ValueError(f"{name}={str(dev)!r}, but this machine has {missing}: {name} must be "
                         f"one of {have}")
    return dev

