"""02-08: the real training set-up a memory prediction is for, and its measured step.

:func:`build` makes the model and optimizer that :func:`course_lib.engine.predict_step_memory`
predicts (the course GPT in the precision's dtype, checkpointed as asked; AdamW, or
:class:`course_lib.mixed_precision.MasterWeightAdamW` in mixed precision);
:func:`train_options` gives :func:`course_lib.training.train` its autocast and loss scaling;
:func:`measure_step_memory` measures a steady-state step of it (the second: AdamW's state
exists before it starts), which lectures 02, 03, 06 and 08 put beside the prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import checkpointing as ckpt
from . import engine
from .checkpointing import enable_checkpointing
from .measure import peak_memory, resident_bytes
from .mixed_precision import MasterWeightAdamW
from .models import GPT, MAX_SEED, GPTConfig, check_config, random_tokens
from .training import make_grad_scaler, train
from .validation import MAX_BATCH, function, integer, number, positive_int
from .validation import available_device as as_device


def model_dtype(precision: str) -> torch.dtype:
    """The dtype of the model's parameters under ``precision`` (fp32 under autocast).

    Args:
        precision (str): one of :data:`course_lib.engine.PRECISIONS`.

    Returns:
        torch.dtype: ``precision_of(precision).params``.

    Raises:
        ValueError: naming ``precision``, for an unknown one.
    """
    return engine.precision_of(precision).params


def build(config: GPTConfig, *, precision: str = "fp32", mode: str = "none", every: int = 1,
          device: str | torch.device = "cpu", lr: float = 1e-3, seed: int = 0):
    """``(model, optimizer)`` for training ``config`` in ``precision`` with checkpointing ``mode``.

    The model is ``GPT(config)`` in :func:`model_dtype` on ``device`` with
    :func:`course_lib.checkpointing.enable_checkpointing`; the optimizer is
    ``torch.optim.AdamW`` left to PyTorch's default implementation (per tensor on the CPU,
    foreach on a GPU: the one :func:`course_lib.engine.predict_step_memory` predicts by
    default), or :class:`course_lib.mixed_precision.MasterWeightAdamW` for the mixed
    precisions. Train it with :func:`train_options` (autocast, loss scaling).

    Args:
        config (GPTConfig): the model.
        precision (str): one of :data:`course_lib.engine.PRECISIONS`.
        mode (str): the checkpointing mode (:data:`course_lib.checkpointing.MODES`).
        every (int): its stride, a positive int.
        device (str or torch.device): "cpu", "cuda", a ``torch.device``.
        lr (float): the learning rate, a finite number >= 0.
        seed (int): seeds ``torch.manual_seed`` before the weights are drawn, an int from 0 to
            :data:`course_lib.models.MAX_SEED` (not a bool or a float).

    Returns:
        tuple: ``(model, optimizer)``.

    Raises:
        ValueError: naming the argument.
    """
    check_config(config)
    spec = engine.precision_of(precision)
    ckpt._check_mode(mode, every, None, config.n_layers)
    device = as_device("device", device)
    lr = number("lr", lr, minimum=0.0)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=spec.params)
    enable_checkpointing(model, mode, every)
    if spec.master:
        return model, MasterWeightAdamW(model.parameters(), lr=lr)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_options(precision: str, device: str | torch.device = "cpu") -> dict:
    """The keyword arguments of :func:`course_lib.training.train` for ``precision``.

    ``amp_dtype`` for the autocast precisions, and a fresh ``GradScaler`` wherever fp16
    computes (fp16-mixed, autocast-fp16); keep the dict for the whole run, so that the
    scaler keeps its scale from step to step.

    Args:
        precision (str): one of :data:`course_lib.engine.PRECISIONS`.
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


def measure_steady_step(model: torch.nn.Module, optimizer, step: Callable[[], object], *,
                        device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of a steady-state optimizer step: resident bytes plus the step's peak.

    Runs ``step()`` once (which creates AdamW's ``m`` and ``v``), counts what ``model`` and
    ``optimizer`` then hold (:func:`course_lib.measure.resident_bytes`), and measures a second
    ``step()`` with :func:`course_lib.measure.peak_memory` (the CUDA allocator on CUDA, the
    live-tensor tracker elsewhere). The sum is what
    :func:`course_lib.engine.predict_step_memory` predicts (its ``total``).

    Args:
        model (torch.nn.Module): the model ``step`` trains.
        optimizer (torch.optim.Optimizer): its optimizer.
        step (callable): one optimizer step (forward, backward of every micro-batch,
            ``optimizer.step()``, ``zero_grad``), called with no arguments.
        device (str or torch.device): where it runs.

    Returns:
        int: bytes.

    Raises:
        ValueError: ``step`` not callable, or a bad ``device``.
    """
    function("step", step)
    device = as_device("device", device)
    step()
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(step, device=device.type)


def measure_step_memory(config: GPTConfig, micro_batch_size: int, accumulation_steps: int = 1, *,
                        precision: str = "fp32", mode: str = "none", every: int = 1,
                        device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of a steady-state step.

    To compare with :func:`course_lib.engine.predict_step_memory`.

    Builds the model and optimizer (:func:`build`) and measures the second step of
    :func:`course_lib.training.train` with :func:`train_options` (:func:`measure_steady_step`).
    The ``micro_batch_size * accumulation_steps`` sequences are seeded random tokens.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences per forward pass.
        accumulation_steps (int): micro-batches per optimizer step; ``micro_batch_size *
            accumulation_steps`` at most :data:`course_lib.validation.MAX_BATCH`.
        precision (str): one of :data:`course_lib.engine.PRECISIONS`.
        mode, every: checkpointing (:func:`course_lib.checkpointing.enable_checkpointing`).
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

    return measure_steady_step(model, optimizer, step, device=device)


__all__ = ["model_dtype", "build", "train_options", "measure_step_memory", "measure_steady_step"]
