"""02-08: the real training set-up a memory prediction is for, and its measured step.

:func:`build` makes the model and optimizer that :func:`course_lib.prediction.predict.predict`
predicts (the course GPT in the precision's dtype, checkpointed as asked; AdamW, or
:class:`course_lib.training.mixed_precision.MasterWeightAdamW` in mixed precision);
:func:`train_options` gives :func:`course_lib.training.loop.train` its autocast and loss scaling;
:func:`measure_step_memory` measures a steady-state step of it (the second: AdamW's state
exists before it starts), which lectures 02, 03, 06 and 08 put beside the prediction.
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
from course_lib.training import checkpointing as ckpt, levers
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.training.loop import make_grad_scaler, train
from course_lib.training.mixed_precision import MasterWeightAdamW
from course_lib.training.policies import backward_ops
from course_lib.validation import (
    MAX_BATCH,
    MAX_COUNT,
    available_device as as_device,
    function,
    integer,
    number,
    positive_int,
)


def build(config: GPTConfig, *, precision: str = "fp32", mode: str = "none", every: int = 1,
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
    ckpt.check_mode(mode, every, None, config.n_layers)
    device = as_device("device", device)
    lr = number("lr", lr, minimum=0.0)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=spec.params)
    enable_checkpointing(model, mode, every)
    if spec.master:
        return model, MasterWeightAdamW(model.parameters(), lr=lr)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


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


def _measure_steady_step(model: torch.nn.Module, optimizer, step: Callable[[], object], *,
                         device: str | torch.device = "cpu") -> int:
    """Resident bytes plus the peak of a second ``step()`` (the first makes AdamW's state)."""
    function("step", step)
    device = as_device("device", device)
    step()
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(step, device=device.type)


@keeps_rng
def measure_step_memory(config: GPTConfig, micro_batch_size: int, accumulation_steps: int = 1, *,
                        precision: str = "fp32", mode: str = "none", every: int = 1,
                        device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of a steady-state step.

    To compare with :func:`course_lib.prediction.predict.predict`.

    Builds the model and optimizer (:func:`build`) and measures the second step of
    :func:`course_lib.training.loop.train` with :func:`train_options`.
    The ``micro_batch_size * accumulation_steps`` sequences are seeded random tokens.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences per forward pass.
        accumulation_steps (int): micro-batches per optimizer step; ``micro_batch_size *
            accumulation_steps`` at most :data:`course_lib.validation.MAX_BATCH`.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        mode, every: checkpointing (:func:`course_lib.training.checkpointing.enable_checkpointing`).
        device (str or torch.device): where it runs.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming the argument.
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    if b * K > MAX_BATCH:
        raise ValueError(f"micro_batch_size * accumulation_steps must be at most {MAX_BATCH:,} "
                         f"sequences, got {b} * {K}")
    device = as_device("device", device)
    model, optimizer = build(config, precision=precision, mode=mode, every=every, device=device)
    options = train_options(precision, device)
    x, y = random_tokens(config, b * K, device=device)

    def step():
        train(model, optimizer, [(x, y)], micro_batch_size=b, accumulation_steps=K, **options)

    return _measure_steady_step(model, optimizer, step, device=device)


@keeps_rng
def measure_chunked_loss_step(config: GPTConfig, micro_batch_size: int, loss_chunk: int,
                              accumulation_steps: int = 1, *, precision: str = "fp32",
                              device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of a steady-state step whose loss is chunked.

    To compare with ``predict(Step(..., loss_chunk=loss_chunk))``.

    As :func:`course_lib.prediction.step_setup.measure_step_memory`, with the model switched to
    :func:`course_lib.training.levers.chunked_cross_entropy` (:func:`course_lib.training.levers.use_chunked_loss`): each micro-batch's mean loss,
    divided by ``accumulation_steps``, is backpropagated, then the optimizer steps.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences per forward pass.
        loss_chunk (int): tokens per chunk.
        accumulation_steps (int): micro-batches per step.
        precision (str): a precision of :data:`course_lib.prediction.engine.PRECISIONS` without autocast
            or loss scaling (fp32, bf16, bf16-mixed).
        device (str or torch.device): where it runs.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming the argument; ``precision`` that autocasts or scales the loss.
    """
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    loss_chunk = positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    device = as_device("device", device)
    model, optimizer = build(config, precision=precision, device=device)
    options = train_options(precision, device)
    if options["amp_dtype"] is not None or options["grad_scaler"] is not None:
        raise ValueError(f"precision must be one without autocast or loss scaling for a chunked "
                         f"loss, got {precision!r}")
    levers.use_chunked_loss(model, loss_chunk)
    x, y = random_tokens(config, b * K, device=device)

    def step():
        for xk, yk in zip(x.split(b), y.split(b)):
            loss = model(xk, yk)[1]
            (loss if K == 1 else loss / K).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _measure_steady_step(model, optimizer, step, device=device)


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


__all__ = ["build", "keeps_rng", "train_options", "measure_step_memory", "measure_chunked_loss_step"]
