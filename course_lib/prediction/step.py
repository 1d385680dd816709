"""02-08: one training step as a value, made and checked once: what every prediction is about.

:func:`course_lib.prediction.predict.predict` returns a :class:`Step`'s memory and time;
planners search with ``dataclasses.replace(step, micro_batch_size=2)``, which checks the new
value again. Everything inward trusts it, and reads its dtypes and device rules from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.prediction.formulas import MAX_WORLD_SIZE, PRECISION, precision_of
from course_lib.training import checkpointing as ckpt
from course_lib.validation import (
    MAX_BATCH,
    MAX_COUNT,
    WrongTypeError,
    boolean,
    integer,
    optional_positive_int,
    positive_int,
)


@dataclass(frozen=True)
class Step:
    """One optimizer step of ``GPT(config)`` with AdamW: how it is run, and where.

    The defaults are the plain step: fp32, one micro-batch, nothing checkpointed, offloaded or
    sharded. A bad field raises as CONTRIBUTING.md says, and so does a combination that does not
    run (a kernel mode without the fused MLP, the optimizer in backward with accumulation, the
    chunked loss under autocast, ``seq_len`` over ``config.seq_len``).
    Raises:
        ValueError: naming the field, for a bad value or a combination that does not run.
    Example:
        >>> from dataclasses import replace
        >>> step = Step(GPTConfig(n_layers=2), micro_batch_size=4, precision="bf16-mixed", gpu="T4")
        >>> step.gpu.name, step.seq_len == step.config.seq_len, step.batch_size
        ('T4', True, 4)
        >>> replace(step, accumulation_steps=8).batch_size
        32
    """

    #: The model.
    config: GPTConfig
    #: Sequences per forward and backward pass, b.
    micro_batch_size: int = 1
    #: Micro-batches per optimizer step, K (lecture 03): activations of one micro-batch.
    accumulation_steps: int = 1
    #: Tokens per sequence (None: ``config.seq_len``; stored resolved).
    seq_len: int | None = None
    #: One of :data:`course_lib.prediction.formulas.PRECISIONS` (lecture 01).
    precision: str = "fp32"
    #: Checkpointing (lectures 04-05): one of :data:`course_lib.training.checkpointing.ALL_MODES`.
    mode: str = "none"
    #: Checkpoint every ``every``-th block (``blocks``, ``selective``, ``attention``).
    every: int = 1
    #: Segments of ``"sqrt"`` (None: about sqrt(n_layers)).
    segments: int | None = None
    #: Where it runs: None or "cpu", a preset name of :data:`course_lib.device.GPUS`, "cuda"
    #: (this kernel's GPU) or a :class:`~course_lib.device.GPU` (stored resolved).
    gpu: GPU | None = None
    #: The first step of a fresh optimizer (AdamW's ``m`` and ``v`` made in it).
    first_step: bool = False
    #: AdamW's multi-tensor implementation; None: PyTorch's default where the step runs.
    foreach: bool | None = None
    #: Tokens per chunk of the chunked loss (lecture 08), or None for the whole logits at once.
    loss_chunk: int | None = None
    #: The optimizer steps each parameter in the backward pass (lecture 08); not with K > 1.
    in_backward: bool = False
    #: Bits per AdamW state value: 32, 8 or 4 (lecture 08).
    state_bits: int = 32
    #: Saved activations kept in host memory (``save_on_cpu``, lecture 08).
    offload_activations: bool = False
    #: Optimizer states and master weights on the host, stepped there (lecture 08).
    offload_optimizer: bool = False
    #: Rank of LoRA adapters on every block linear, the rest frozen (None: full training).
    lora_rank: int | None = None
    #: ZeRO stage 0-3 over ``world_size`` GPUs (lecture 07).
    zero_stage: int = 0
    #: GPUs the ZeRO shards are divided over.
    world_size: int = 1

    def __post_init__(self):
        config = check_config(self.config)
        put = object.__setattr__  # frozen: the checked values are stored as plain ints
        for name, most in (("micro_batch_size", MAX_BATCH), ("accumulation_steps", MAX_BATCH),
                           ("every", MAX_COUNT), ("world_size", MAX_WORLD_SIZE)):
            put(self, name, positive_int(name, getattr(self, name), maximum=most))
        for name, most in (("loss_chunk", MAX_COUNT), ("lora_rank", config.d_model)):
            put(self, name, optional_positive_int(name, getattr(self, name), maximum=most))
        put(self, "seq_len", config.seq_len if self.seq_len is None else positive_int(
            "seq_len", self.seq_len, maximum=config.seq_len))
        spec = precision_of(self.precision)
        ckpt.check_mode(self.mode, self.every, self.segments, config.n_layers)
        ckpt.check_kernel_mode(self.mode, config)
        put(self, "gpu", resolve_gpu(self.gpu))
        for name in ("first_step", "in_backward", "offload_activations", "offload_optimizer"):
            boolean(name, getattr(self, name))
        if self.foreach is not None:
            boolean("foreach", self.foreach)
        if self.loss_chunk is not None and spec.autocast:
            raise ValueError(f"loss_chunk is predicted without autocast only, got "
                             f"precision={self.precision!r}")
        if self.state_bits not in (32, 8, 4) or type(self.state_bits) is not int:
            raise (ValueError if type(self.state_bits) is int else WrongTypeError)(
                f"state_bits must be one of (32, 8, 4), got {self.state_bits!r}")
        put(self, "zero_stage", integer("zero_stage", self.zero_stage, minimum=0, maximum=3))
        if self.in_backward and self.accumulation_steps > 1:
            raise ValueError("in_backward cannot be combined with accumulation_steps > 1: the "
                             "optimizer would step after every micro-batch")

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step: ``micro_batch_size * accumulation_steps``."""
        return self.micro_batch_size * self.accumulation_steps

    @property
    def runs_foreach(self) -> bool:
        """Whether AdamW steps as one multi-tensor op (None ``foreach``: on a GPU, as PyTorch)."""
        return kernels.adamw_foreach(self.gpu) if self.foreach is None else self.foreach

    @property
    def spec(self):
        """The precision's record in :data:`course_lib.prediction.formulas.PRECISION`."""
        return PRECISION[self.precision]

    @property
    def compute(self) -> torch.dtype:
        """The dtype activations are computed in (under autocast, the autocast dtype)."""
        return self.spec.compute

    @property
    def autocast(self) -> bool:
        """Whether the forward pass runs under ``torch.autocast``."""
        return self.spec.autocast

    @property
    def stream(self) -> torch.dtype:
        """The residual stream's dtype: fp32 under autocast, else the compute dtype."""
        return torch.float32 if self.autocast else self.compute

    @property
    def stats(self) -> torch.dtype:
        """LayerNorm's saved mean and 1/std (:func:`course_lib.model.kernels.stats_dtype`)."""
        return kernels.stats_dtype(self.stream, self.gpu)

    def mask(self, dtype: torch.dtype) -> torch.dtype:
        """Dropout's saved mask on input of ``dtype`` (``kernels.mask_dtype``).
        Args:
            dtype (torch.dtype): the dropout input's dtype.
        Returns:
            torch.dtype: the mask's dtype.
        """
        return kernels.mask_dtype(dtype, self.gpu)


__all__ = ["Step"]
