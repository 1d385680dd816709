"""02-08: where a prediction's step runs (the GPU, or the CPU's kernels) and in which dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model import kernels
from course_lib.units import as_dtype
from course_lib.validation import boolean

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """Where a step runs and in which dtypes: resolved once, asked by every device rule."""

    compute: torch.dtype
    stream: torch.dtype
    gpu: GPU | None
    autocast: bool

    @classmethod
    def resolve(cls, dtype=torch.float32, gpu=None, autocast: bool = False) -> Target:
        """The target of a prediction's arguments, checked and resolved."""
        dtype = as_dtype(dtype)
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
        boolean("autocast", autocast)
        if autocast and dtype == torch.float32:
            raise ValueError("autocast=True needs a 16-bit dtype (torch.bfloat16 or torch.float16)")
        return cls(dtype, torch.float32 if autocast else dtype, resolve_gpu(gpu), autocast)

    def mask(self, dtype: torch.dtype) -> torch.dtype:
        """Dropout's saved mask on input of ``dtype`` (:func:`kernels.mask_dtype`)."""
        return kernels.mask_dtype(dtype, self.gpu)

    @property
    def stats(self) -> torch.dtype:
        """LayerNorm's saved mean and 1/std (:func:`kernels.stats_dtype`)."""
        return kernels.stats_dtype(self.stream, self.gpu)


__all__ = ["Target"]
