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

    A public entry of the prediction wing resolves its arguments once, a precision and a GPU
    (:meth:`of`) or a dtype, a GPU and autocast (:meth:`resolve`), and passes the target inward;
    every rule that depends on the device (the attention kernel, dropout's mask, LayerNorm's
    statistics, the allocator's rounding) is asked of it.

    Attributes:
        compute (torch.dtype): the matmuls' inputs and outputs.
        stream (torch.dtype): the residual stream and LayerNorm: fp32 under autocast (the model's
            weights and the stream stay fp32), else ``compute``.
        gpu (GPU or None): the GPU (a preset of :data:`course_lib.device.GPUS` or this machine's),
            or None for the CPU's kernels.
        autocast (bool): ``torch.autocast`` runs over an fp32 model.
        precision (Precision, optional): the recipe it came from (:meth:`of`), with the dtypes
            of every model state; None when built from a dtype (:meth:`resolve`).
    """

    compute: torch.dtype
    stream: torch.dtype
    gpu: GPU | None
    autocast: bool
    precision: Precision | None = None

    @classmethod
    def of(cls, precision: str, gpu=None) -> Target:
        """The target of a precision recipe on a GPU: its compute dtype and autocast.

        Args:
            precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
            gpu (str or GPU, optional): what :func:`course_lib.device.resolve_gpu` takes.

        Returns:
            Target: with ``precision`` set.

        Raises:
            ValueError: naming ``precision`` or ``gpu``.
        """
        spec = precision_of(precision)
        return replace(cls.resolve(spec.compute, gpu, spec.autocast), precision=spec)

    @classmethod
    def resolve(cls, dtype=torch.float32, gpu=None, autocast: bool = False) -> Target:
        """The target of a prediction's arguments, checked and resolved.

        Args:
            dtype (torch.dtype or str): the matmuls' dtype, one of :data:`FLOAT_DTYPES`.
            gpu (str or GPU, optional): what :func:`course_lib.device.resolve_gpu` takes.
            autocast (bool): ``torch.autocast`` over an fp32 model (a 16-bit ``dtype``).

        Returns:
            Target: the resolved target.

        Raises:
            ValueError: naming ``dtype`` (not one of :data:`FLOAT_DTYPES`), ``gpu``, or
                ``autocast`` (not a bool, or True with fp32).
        """
        dtype = as_dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        boolean("autocast", autocast)
        if autocast and dtype == torch.float32:
            raise ValueError("autocast=True needs a 16-bit dtype (torch.bfloat16 or torch.float16)")
        return cls(dtype, torch.float32 if autocast else dtype, resolve_gpu(gpu), autocast)

    def mask(self, dtype: torch.dtype) -> torch.dtype:
        """Dropout's saved mask on input of ``dtype`` (:func:`course_lib.model.kernels.mask_dtype`).

        Args:
            dtype (torch.dtype): the dropout's input.

        Returns:
            torch.dtype: the mask's dtype.
        """
        return kernels.mask_dtype(dtype, self.gpu)

    @property
    def stats(self) -> torch.dtype:
        """LayerNorm's saved mean and 1/std (:func:`course_lib.model.kernels.stats_dtype`)."""
        return kernels.stats_dtype(self.stream, self.gpu)

    def allocated(self, nbytes: int) -> int:
        """Bytes a tensor of ``nbytes`` takes from the allocator (:func:`course_lib.model.kernels.allocated`).

        Args:
            nbytes (int): the tensor's bytes.

        Returns:
            int: bytes, rounded up to the allocator's block on a GPU.
        """
        return kernels.allocated(nbytes, self.gpu)

    def attention_kernel(self, config: GPTConfig) -> str:
        """The attention kernel ``config`` runs with here (:func:`course_lib.model.kernels.attention_kernel`).

        Args:
            config (GPTConfig): the model.

        Returns:
            str: ``"explicit"`` or one of :data:`course_lib.model.kernels.SDPA_KERNELS`.
        """
        return kernels.attention_kernel(config, self.compute, self.gpu)


__all__ = ["FLOAT_DTYPES", "Target"]
