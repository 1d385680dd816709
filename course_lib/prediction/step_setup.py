"""02-08: the real training set-up a memory prediction is for, and its measured step.

:func:`build` makes the model and optimizer that :func:`course_lib.prediction.predict.predict`
predicts (the course GPT in the precision's dtype, checkpointed as asked; AdamW, or
:class:`course_lib.training.mixed_precision.MasterWeightAdamW` in mixed precision);
:func:`train_options` gives :func:`course_lib.training.loop.train` its autocast and loss scaling;
:func:`measure_step_memory` runs a :class:`~course_lib.prediction.step.Step` on it and measures
its peak, which lectures 02, 03, 06 and 08 put beside ``predict(step).total``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.device import resolve_gpu
from course_lib.measurement.memory import peak_memory, resident_bytes
from course_lib.model.gpt import GPT, MAX_SEED, GPTConfig, check_config, random_tokens
from course_lib.prediction import activations as act, checkpointed, engine
from course_lib.prediction.step import Step
from course_lib.training import checkpointing as ckpt, levers
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.training.loop import make_grad_scaler, train
from course_lib.training.mixed_precision import MasterWeightAdamW
from course_lib.training.policies import backward_ops
from course_lib.validation import (
    MAX_BATCH,
    WrongTypeError,
    available_device as as_device,
    boolean,
    integer,
    number,
    positive_int,
)


def build(config: GPTConfig, *, precision: str = "fp32", mode: str = "none", every: int = 1,
          segments: int | None = None, foreach: bool | None = None,
          device: str | torch.device = "cpu", lr: float = 1e-3, seed: int = 0):
    """``(model, optimizer)`` for training ``config`` in ``precision`` with checkpointing ``mode``.

    The model is ``GPT(config)`` in the precision's parameter dtype on ``device`` with
    :func:`course_lib.training.checkpointing.enable_checkpointing`; the optimizer is
    ``torch.optim.AdamW`` left to PyTorch's default implementation (per tensor on the CPU,
    foreach on a GPU: the one :func:`course_lib.prediction.predict.predict` predicts by
    default), or :class:`course_lib.training.mixed_precision.MasterWeightAdamW` for the mixed
    precisions. Train it with :func:`train_options` (autocast, loss scaling).

    Args:
        config (GPTConfig): the model.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        mode (str): the checkpointing mode (:data:`course_lib.training.checkpointing.MODES`).
        every (int): its stride, a positive int.
        segments (int, optional): the segments of ``"sqrt"`` mode (None: about sqrt(n_layers)).
        foreach (bool, optional): AdamW's multi-tensor implementation (None: PyTorch's default).
        device (str or torch.device): "cpu", "cuda", a ``torch.device``.
        lr (float): the learning rate, a finite number >= 0.
        seed (int): seeds ``torch.manual_seed`` before the weights are drawn, an int from 0 to
            :data:`course_lib.model.gpt.MAX_SEED` (not a bool or a float).

    Returns:
        tuple: ``(model, optimizer)``.

    Raises:
        ValueError: naming the argument.
    """
    check_config(config)
    spec = engine.precision_of(precision)
    ckpt.check_mode(mode, every, segments, config.n_layers)
    if foreach is not None:
        boolean("foreach", foreach)
    device = as_device("device", device)
    lr = number("lr", lr, minimum=0.0)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=spec.params)
    enable_checkpointing(model, mode, every, segments=segments)
    if spec.master:
        return model, MasterWeightAdamW(model.parameters(), lr=lr, foreach=foreach)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)


def keeps_rng(measure: Callable) -> Callable:
    """``measure`` on a fork of the global RNG, which comes back as it was: a measurement that
    builds its model with :func:`build` (``torch.manual_seed``) leaves the caller's random
    numbers alone."""
    @functools.wraps(measure)
    def measured(*args, **kwargs):
        with torch.random.fork_rng():
            return measure(*args, **kwargs)
    return measured


def train_options(precision: str, device: str | torch.device = "cpu") -> dict:
    """The keyword arguments of :func:`course_lib.training.loop.train` for ``precision``.

    ``amp_dtype`` for the autocast precisions, and a fresh ``GradScaler`` wherever fp16
    computes (fp16-mixed, autocast-fp16); keep the dict for the whole run, so that the
    scaler keeps its scale from step to step.

    Args:
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        device (str or torch.device): where training runs (the scaler's device type).

    Returns:
        dict: ``{"amp_dtype": ..., "grad_scaler": ...}``.

    Raises:
        ValueError: naming ``precision`` or ``device``.
    """
    spec = engine.precision_of(precision)
    device = as_device("device", device)
    options = {"amp_dtype": spec.compute if spec.autocast else None, "grad_scaler": None}
    if spec.grad_scaler:
        options["grad_scaler"] = make_grad_scaler(device.type)
    return options


#: The levers a measured step runs without, each with the value that leaves it out.
_UNMEASURED = {"in_backward": False, "state_bits": 32, "offload_activations": False,
               "offload_optimizer": False, "lora_rank": None, "zero_stage": 0, "world_size": 1}


@keeps_rng
def measure_step_memory(step: Step, *, device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of ``step``: what ``predict(step).total`` predicts.

    Builds the model and optimizer (:func:`build`, with the step's precision, checkpointing and
    ``foreach``; the chunked loss when ``step.loss_chunk`` is set) and runs
    :func:`course_lib.training.loop.train` with :func:`train_options` on seeded random tokens.
    Returns the resident bytes plus the peak of the second step (AdamW's state is made in the
    first), or of the first with ``step.first_step``. ``step.gpu`` is what the prediction
    assumes; ``device`` is where this runs.

    Args:
        step (Step): the step; the levers of lectures 07 and 08 other than ``loss_chunk`` left
            out.
        device (str or torch.device): "cpu", "cuda", a ``torch.device``.

    Returns:
        int: bytes.

    Raises:
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step`.
        ValueError: naming ``device``, or the field of a lever this does not run.
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a course_lib.prediction.step.Step, got "
                             f"{type(step).__name__}")
    for name, plain in _UNMEASURED.items():
        if getattr(step, name) != plain:
            raise ValueError(f"{name} must be {plain!r} to measure a step here (this runs plain "
                             f"AdamW on one device), got {getattr(step, name)!r}")
    device = as_device("device", device)
    model, optimizer = build(step.config, precision=step.precision, mode=step.mode,
                             every=step.every, segments=step.segments, foreach=step.foreach,
                             device=device)
    if step.loss_chunk is not None:
        levers.use_chunked_loss(model, step.loss_chunk)
    options = train_options(step.precision, device)
    x, y = random_tokens(step.config, step.batch_size, step.seq_len, device=device)

    def run():
        train(model, optimizer, [(x, y)], micro_batch_size=step.micro_batch_size,
              accumulation_steps=step.accumulation_steps, **options)

    if not step.first_step:
        run()
    return resident_bytes(model, optimizer) + peak_memory(run, device=device.type)


@dataclass(frozen=True)
class _KernelPolicy:
    """One policy of the course kernel, measured and predicted (:func:`_kernel_policies`)."""

    mode: str
    kept_measured: int
    kept_predicted: int
    kernel_runs: int


@keeps_rng
def _kernel_policies(config: GPTConfig, batch_size: int, *, precision: str = "fp32",
                     device: str | torch.device = "cpu", gpu=None) -> list[_KernelPolicy]:
    """The course kernel's two policies side by side, each in a fresh model: kept bytes measured
    and predicted, and the kernel's runs in the backward pass. Lecture 05, section 4."""
    check_config(config)
    if not config.fused_mlp:
        raise ValueError("config must have fused_mlp=True: the policies are the course kernel's")
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    spec = engine.precision_of(precision)
    device, gpu = as_device("device", device), resolve_gpu(gpu)
    # No cast cache: it would hold every block's 16-bit weight copies until autocast exits,
    # though a checkpointed block keeps none of them for backward (14.2 MB a block of width 768
    # on an H200, counted as kept); without it each matmul keeps only the copy it saves.
    amp = dict(device_type=device.type, dtype=spec.compute, enabled=spec.autocast,
               cache_enabled=False)
    kernel, = ckpt.KERNEL_OPS
    rows = []
    for mode in ckpt.KERNEL_MODES:
        model, _ = build(config, precision=precision, mode=mode, device=device)
        x, y = random_tokens(config, batch_size, device=device)
        with torch.autocast(**amp):
            kept = ckpt.measure_kept_bytes(model, x, y)
            loss = model(x, y)[1]
        items = checkpointed.kept_items(config, batch_size, mode, dtype=spec.compute, gpu=gpu,
                                autocast=spec.autocast)
        rows.append(_KernelPolicy(mode, kept, act.total_bytes(items, act.STEP_KINDS),
                                 backward_ops(loss)[kernel]))
    return rows


__all__ = ["build", "keeps_rng", "train_options", "measure_step_memory"]
