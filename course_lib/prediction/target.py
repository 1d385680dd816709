"""02-08: what a prediction is for: the GPU (or the CPU's kernels), the precision, the dtypes.

Every prediction of this wing (saved activations, kept bytes, the engine's peak, the time model's
bytes) depends on where the step runs and in which dtypes. :class:`Target` holds both, resolved
once from a public function's arguments, and answers the device's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig
from course_lib.prediction.formulas import Precision, precision_of
from course_lib.units import as_dtype
from course_lib.validation import boolean

#: The dtypes a step's matmuls can run in.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """What a prediction is for: where the step runs and the dtypes it runs in.

    A public entry resolves its arguments once (:meth:`of`; :meth:`resolve`, a dtype of
    :data:`FLOAT_DTYPES`) and passes the target inward; every device-dependent rule (attention
    kernel, mask, LayerNorm statistics, rounding) asks it.
    """

    compute: torch.dtype
    stream: torch.dtype
    gpu: GPU | None
    autocast: bool
    precision: Precision | None = None

    @classmethod
    def of(cls, precision: str, gpu=None) -> Target:
        """The target of a precision recipe on a GPU: its compute dtype and autocast."""
        spec = precision_of(precision)
        return replace(cls.resolve(spec.compute, gpu, spec.autocast), precision=spec)

    @classmethod
    def resolve(cls, dtype=torch.float32, gpu=None, autocast: bool = False) -> Target:
        """The target of a prediction's arguments, checked and resolved."""
        dtype = as_dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        boolean("autocast", autocast)
        if autocast and dtype == torch.float32:
            raise ValueError("autocast=True needs a 16-bit dtype (torch.bfloat16 or torch.float16)")
        return cls(dtype, torch.float32 if autocast else dtype, resolve_gpu(gpu), autocast)

    def mask(self, dtype: torch.dtype) -> torch.dtype:
        """Dropout's saved mask on input of ``dtype``
        (:func:`course_lib.model.kernels.mask_dtype`)."""
        return kernels.mask_dtype(dtype, self.gpu)

    @property
    def stats(self) -> torch.dtype:
        """LayerNorm's saved mean and 1/std (:func:`course_lib.model.kernels.stats_dtype`)."""
        return kernels.stats_dtype(self.stream, self.gpu)

    def allocated(self, nbytes: int) -> int:
        """Bytes a tensor of ``nbytes`` takes from the allocator
        (:func:`course_lib.model.kernels.allocated`)."""
        return kernels.allocated(nbytes, self.gpu)

    def attention_kernel(self, config: GPTConfig) -> str:
        """The attention kernel ``config`` runs with here
        (:func:`course_lib.model.kernels.attention_kernel`)."""
        return kernels.attention_kernel(config, self.compute, self.gpu)


__all__ = ["FLOAT_DTYPES", "Target"]
