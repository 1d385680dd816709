"""02-08: the real training set-up a prediction is for, and its measured step.

:func:`build` makes the model and optimizer that :func:`course_lib.prediction.predict.predict`
predicts; :func:`train_options` gives :func:`course_lib.training.loop.train` its autocast and
loss scaling; :func:`measure_step_memory` runs a :class:`~course_lib.prediction.step.Step` on
them and measures its peak, which lectures 02, 03, 06 and 08 put beside ``predict(step).total``.
"""

from __future__ import annotations

import torch

from course_lib.measurement.memory import peak_memory, resident_bytes
from course_lib.model.gpt import GPT, MAX_SEED, GPTConfig, check_config, random_tokens
from course_lib.prediction.formulas import precision_of
from course_lib.prediction.step import Step
from course_lib.training import checkpointing as ckpt, levers
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.training.loop import make_grad_scaler, train
from course_lib.training.mixed_precision import MasterWeightAdamW
from course_lib.validation import (
    WrongTypeError,
    available_device as as_device,
    boolean,
    integer,
    number,
)


def build(config: GPTConfig, *, precision: str = "fp32", mode: str = "none", every: int = 1,
          segments: int | None = None, foreach: bool | None = None,
          device: str | torch.device = "cpu", lr: float = 1e-3, seed: int = 0):
    """``(model, optimizer)``: ``GPT(config)`` in the precision's dtype on ``device``, seeded and
    checkpointed as asked; AdamW (``foreach`` None: PyTorch's default, as ``predict`` assumes),
    or :class:`course_lib.training.mixed_precision.MasterWeightAdamW` in mixed precision.
    Args:
        config (GPTConfig): the course GPT's shape.
        precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
        mode, every, segments: as :func:`course_lib.training.checkpointing.enable_checkpointing`.
        foreach (bool, optional): AdamW's multi-tensor implementation, as above.
        device, lr, seed: the model's device, AdamW's learning rate, the weights' seed.
    Returns:
        tuple: ``(model, optimizer)``.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    spec = precision_of(precision)
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


#: Decorates a measurement to run on a fork of the global RNG, so that one that seeds it
#: (:func:`build`) leaves the caller's random numbers alone (a ``contextmanager`` decorates).
keeps_rng = torch.random.fork_rng()


def train_options(precision: str, device: str | torch.device = "cpu") -> dict:
    """The keyword arguments of :func:`course_lib.training.loop.train` for ``precision``.

    ``amp_dtype`` for the autocast precisions, and a fresh ``GradScaler`` wherever fp16
    computes: keep the dict for the whole run, so that the scaler keeps its scale.
    Args:
        precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
        device (str or torch.device): where the run computes.
    Returns:
        dict: ``amp_dtype`` and ``grad_scaler``.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    spec = precision_of(precision)
    device = as_device("device", device)
    return {"amp_dtype": spec.compute if spec.autocast else None,
            "grad_scaler": make_grad_scaler(device.type) if spec.grad_scaler else None}


#: The levers a measured step runs without, each with the value that leaves it out.
_UNMEASURED = {"in_backward": False, "state_bits": 32, "offload_activations": False,
               "offload_optimizer": False, "lora_rank": None, "zero_stage": 0, "world_size": 1}


@keeps_rng
def measure_step_memory(step: Step, *, device: str | torch.device = "cpu") -> int:
    """Measured peak bytes of ``step``: what ``predict(step).total`` predicts.

    Runs :func:`course_lib.training.loop.train` on the :func:`build` set-up (the chunked loss
    with ``step.loss_chunk``) with seeded random tokens, on ``device`` (``step.gpu`` is what the
    prediction assumes). Returns the resident bytes plus the peak of the second step (AdamW's
    state is made in the first), or of the first with ``step.first_step``. The levers of
    lectures 07 and 08 other than ``loss_chunk`` are refused.
    Args:
        step (Step): the step to run.
        device (str or torch.device): where it runs.
    Returns:
        int: the peak bytes.
    Raises:
        ValueError: naming the lever, for a lever refused, or a bad ``device``.
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


__all__ = ["build", "keeps_rng", "train_options", "measure_step_memory"]
