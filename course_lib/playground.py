"""03: the accumulation playground's back end: short, real, measured training runs.

:class:`Playground` trains a fresh course GPT (same seed, same data) for a
fixed budget of samples with a given micro-batch size ``b``, number of
accumulation steps ``K`` and per-block activation checkpointing on or off, and
reports the effective batch ``b*K``, the optimizer steps ``samples // (b*K)``,
the loss curve, and the peak memory of a training step, predicted and measured.
Runs are cached by their settings, so a widget can redraw instantly and train
only when asked.

Memory, in bytes, of one steady-state step (the optimizer state exists):

* measured: the bytes resident before the step (weights and AdamW's ``m``, ``v``)
  plus :func:`course_lib.measure.peak_memory` of the step (``K`` forward and
  backward passes, ``optimizer.step()``, ``zero_grad``);
* predicted: the memory engine's ``total``
  (:func:`course_lib.engine.predict_step_memory`, fp32, for the playground's
  device). From ``K = 2`` on the whole gradient is alive during every backward
  pass, so the prediction (an upper bound there) does not change with ``K``: that
  is the claim under test; ``K = 1`` peaks lower, before the gradient is whole.

Checkpointing uses :func:`course_lib.checkpointing.enable_checkpointing`
(``mode="blocks"``: ``torch.utils.checkpoint`` around every block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checkpointing import enable_checkpointing
from .device import resolve_gpu
from .engine import predict_step_memory
from .measure import peak_memory, resident_bytes
from .models import GPT, GPTConfig
from .training import MAX_SEED, batches_of, markov_tokens, train
from .validation import MAX_BATCH, boolean, function, integer, number, positive_int
from .validation import device as as_device

#: The most samples a playground trains on, and the largest micro-batch and accumulation
#: steps it takes (each at most :data:`course_lib.validation.MAX_BATCH`).
MAX_SAMPLES = MAX_BATCH


def effective_batch(micro_batch_size: int, accumulation_steps: int) -> int:
    """Samples per optimizer step: ``micro_batch_size * accumulation_steps``.

    Each is an int (not a bool) from 1 to :data:`course_lib.validation.MAX_BATCH`; ``ValueError``
    naming it otherwise.
    """
    return positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH) * positive_int(
        "accumulation_steps", accumulation_steps, maximum=MAX_BATCH)


def optimizer_steps(samples: int, micro_batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in a budget of ``samples``: ``samples // (micro_batch_size * accumulation_steps)``.

    ``samples``: an int from 1 to :data:`MAX_SAMPLES`; the others as :func:`effective_batch`.
    """
    samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
    return samples // effective_batch(micro_batch_size, accumulation_steps)


def step_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, *,
                log=None, **train_kwargs) -> int:
    """Bytes of one training step on ``batch`` (an ``(inputs, targets)`` pair): resident plus peak.

    :func:`resident_bytes` before the step (weights and whatever optimizer state
    exists) plus :func:`course_lib.measure.peak_memory` of
    ``course_lib.training.train(model, optimizer, [batch], **train_kwargs)``.
    Run one step first for the steady state (AdamW creates ``m`` and ``v`` in
    its first step). ``log``: a ``TrainLog`` the step is appended to.

    Raises:
        ValueError: naming ``model`` (not an ``nn.Module``), ``optimizer`` (no ``step``) or
            ``batch`` (not a pair of tensors).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(optimizer, "step", None)):
        raise ValueError(f"optimizer must be an optimizer (with step()), got "
                         f"{type(optimizer).__name__}")
    if not (isinstance(batch, tuple | list) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"batch must be an (inputs, targets) pair of tensors, got "
                         f"{type(batch).__name__}")
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(lambda: train(model, optimizer, [batch], log=log, **train_kwargs))


@dataclass(frozen=True)
class Run:
    """One cached playground run; memory in bytes."""

    micro_batch_size: int
    accumulation_steps: int
    checkpointing: bool
    effective_batch: int
    optimizer_steps: int
    measured_peak: int
    predicted_peak: int
    samples_seen: tuple[int, ...]
    losses: tuple[float, ...]


class Playground:
    """Short training runs of one GPT ``config`` on :func:`course_lib.training.markov_tokens`.

    ``samples``: the training budget of every run (the effective batch sets how
    many optimizer steps it buys), an int from 1 to :data:`MAX_SAMPLES`. ``lr``: AdamW's
    learning rate, the same for every run, a finite number > 0. ``seed``: an int from 0 to
    :data:`course_lib.training.MAX_SEED`. ``device``: a device ("cpu", "cuda", ...).
    Each is checked (``ValueError`` naming it).
    """

    def __init__(self, config: GPTConfig | None = None, *, samples: int = 384, lr: float = 1e-2,
                 seed: int = 0, device: torch.device | str = "cpu"):
        self.config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=4) \
            if config is None else config
        if not isinstance(self.config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
        lr = number("lr", lr, above=0.0)
        seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
        self.lr, self.seed, self.device = lr, seed, as_device("device", device)
        self._gpu = resolve_gpu("cuda") if self.device.type == "cuda" else None
        self.data = markov_tokens(samples, self.config.seq_len, self.config.vocab_size,
                                  seed=seed, device=self.device)
        self.cache: dict[tuple[int, int, bool], Run] = {}

    def _model(self, checkpointing: bool) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model = GPT(self.config).to(self.device)
        if checkpointing:
            enable_checkpointing(model, mode="blocks", every=1)
        # foreach=False: the per-tensor AdamW whose scratch the engine counts (on CUDA the
        # default is the multi-tensor one, which holds a copy of v at once).
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr, foreach=False)

    def predict_peak(self, micro_batch_size: int, accumulation_steps: int,
                     checkpointing: bool = False) -> int:
        """The engine's peak bytes of a steady-state step with these settings (see the module doc)."""
        boolean("checkpointing", checkpointing)
        return predict_step_memory(self.config, micro_batch_size, accumulation_steps,
                                   mode="blocks" if checkpointing else "none",
                                   gpu=self._gpu).total

    def cached(self, micro_batch_size: int, accumulation_steps: int,
               checkpointing: bool = False) -> Run | None:
        """The run with these settings if it has been trained, else None."""
        effective_batch(micro_batch_size, accumulation_steps)
        boolean("checkpointing", checkpointing)
        return self.cache.get((micro_batch_size, accumulation_steps, checkpointing))

    def run(self, micro_batch_size: int, accumulation_steps: int, checkpointing: bool = False, *,
            on_step: Callable[[int, float], None] | None = None) -> Run:
        """Train (or fetch from the cache) one run with these settings.

        ``on_step(step, loss)`` is called after every optimizer step of a new run
        (a widget shows the progress with it).
        """
        b = effective_batch(micro_batch_size, accumulation_steps)
        boolean("checkpointing", checkpointing)
        function("on_step", on_step, optional=True)
        key = (micro_batch_size, accumulation_steps, checkpointing)
        if key in self.cache:
            return self.cache[key]
        steps = optimizer_steps(self.samples, micro_batch_size, accumulation_steps)
        if steps < 2:
            raise ValueError(f"micro_batch_size * accumulation_steps must be at most "
                             f"{self.samples // 2} (two optimizer steps in {self.samples} samples), "
                             f"got {b}")
        model, opt = self._model(checkpointing)
        batches = batches_of(*self.data, b)
        kw = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                  on_step=on_step)
        log = train(model, opt, batches[:1], **kw)  # the first step creates AdamW's m and v
        measured = step_memory(model, opt, batches[1], log=log, **kw)
        train(model, opt, batches[2:], log=log, **kw)
        result = Run(micro_batch_size, accumulation_steps, bool(checkpointing), b, steps,
                     measured_peak=measured,
                     predicted_peak=self.predict_peak(*key),
                     samples_seen=tuple(b * (i + 1) for i in range(log.steps)),
                     losses=tuple(log.losses))
        self.cache[key] = result
        return result
