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
  plus :func:`course_lib.measurement.memory.peak_memory` of the step (``K`` forward and
  backward passes, ``optimizer.step()``, ``zero_grad``);
* predicted: ``predict(Step(...)).total`` (:mod:`course_lib.prediction.predict`, fp32, for
  the playground's device). From ``K = 2`` on the whole gradient is alive during every backward
  pass, so the prediction (an upper bound there) does not change with ``K``: that
  is the claim under test; ``K = 1`` peaks lower, before the gradient is whole.

Checkpointing uses :func:`course_lib.training.checkpointing.enable_checkpointing`
(``mode="blocks"``: ``torch.utils.checkpoint`` around every block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.device import resolve_gpu
from course_lib.measurement.memory import peak_memory, resident_bytes
from course_lib.measurement.timing import CLOCKS, MAX_RUNS, step_times
from course_lib.model.gpt import GPT, MAX_SEED, GPTConfig, check_batch, check_config
from course_lib.model.toy_data import markov_tokens
from course_lib.prediction.predict import Step, predict
from course_lib.prediction.step_setup import build, measure_step_memory, train_options
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.training.loop import batches_of, train
from course_lib.validation import (
    MAX_BATCH,
    WrongTypeError,
    available_device as as_device,
    choice,
    function,
    integer,
    number,
    positive_int,
)

#: The most samples a playground trains on, and the largest micro-batch and accumulation
#: steps it takes (each at most :data:`course_lib.validation.MAX_BATCH`).
MAX_SAMPLES = MAX_BATCH


def effective_batch(micro_batch_size: int, accumulation_steps: int) -> int:
    """Samples per optimizer step: ``micro_batch_size * accumulation_steps``, each checked."""
    return positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH) * positive_int(
        "accumulation_steps", accumulation_steps, maximum=MAX_BATCH)


def optimizer_steps(samples: int, micro_batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in a budget of ``samples``: ``samples // effective_batch(...)``."""
    samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
    return samples // effective_batch(micro_batch_size, accumulation_steps)


def _step_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, *,
                log=None, **train_kwargs) -> int:
    """Bytes of one training step on ``batch``, an ``(inputs, targets)`` pair:
    :func:`resident_bytes` before it plus the :func:`~course_lib.measurement.memory.peak_memory`
    of ``train(model, optimizer, [batch], **train_kwargs)``; run one step first for the steady
    state."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(optimizer, "step", None)):
        raise ValueError(f"optimizer must be an optimizer (with step()), got "
                         f"{type(optimizer).__name__}")
    if not (isinstance(batch, tuple | list) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"batch must be an (inputs, targets) pair of tensors, got "
                         f"{type(batch).__name__}")
    check_batch(model, *batch, names=("batch's inputs", "batch's targets"))
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(lambda: train(model, optimizer, [batch], log=log, **train_kwargs))


#: The checkpointing modes the playground runs: none, or every block checkpointed.
PLAYGROUND_MODES = ("none", "blocks")


@dataclass(frozen=True)
class Run:
    """One cached playground run; memory in bytes.

    Attributes:
        micro_batch_size (int): sequences per forward and backward pass.
        accumulation_steps (int): micro-batches per optimizer step.
        mode (str): ``"none"``, or ``"blocks"`` (every block checkpointed).
        effective_batch (int): ``micro_batch_size * accumulation_steps``.
        optimizer_steps (int): steps the run's sample budget bought.
        measured_peak (int): bytes of the second (steady-state) step, measured
            (:func:`_step_memory`).
        predicted_peak (int): the predicted bytes of the same step.
        samples_seen (tuple of int): samples trained on after each optimizer step.
        losses (tuple of float): the loss of each optimizer step.
    """

    micro_batch_size: int
    accumulation_steps: int
    mode: str
    effective_batch: int
    optimizer_steps: int
    measured_peak: int
    predicted_peak: int
    samples_seen: tuple[int, ...]
    losses: tuple[float, ...]


class Playground:
    """Short training runs of one GPT ``config`` on :func:`course_lib.model.toy_data.markov_tokens`.

    Args:
        config (GPTConfig, optional): the model; default a 4-layer GPT of width 32 on 64 tokens
            and sequences of 32.
        samples (int): the training budget of every run (the effective batch sets how
            many optimizer steps it buys), an int from 1 to :data:`MAX_SAMPLES`.
        lr (float): AdamW's learning rate, the same for every run, a finite number > 0.
        seed (int): an int from 0 to :data:`course_lib.model.gpt.MAX_SEED`.
        device (str or torch.device): "cpu", "cuda", ...

    Raises:
        ValueError: naming the parameter, for a bad value.
    """

    def __init__(self, config: GPTConfig | None = None, *, samples: int = 384, lr: float = 1e-2,
                 seed: int = 0, device: torch.device | str = "cpu"):
        self.config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=4) \
            if config is None else check_config(config)
        self.samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
        lr = number("lr", lr, above=0.0)
        seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
        self.lr, self.seed, self.device = lr, seed, as_device("device", device)
        self._gpu = resolve_gpu("cuda") if self.device.type == "cuda" else None
        self.data = markov_tokens(samples, self.config.seq_len, self.config.vocab_size,
                                  seed=seed, device=self.device)
        self.cache: dict[tuple[int, int, bool], Run] = {}

    def _model(self, mode: str) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model = GPT(self.config).to(self.device)
        if mode != "none":
            enable_checkpointing(model, mode=mode)
        # foreach=False: the per-tensor AdamW whose scratch the engine counts (on CUDA the
        # default is the multi-tensor one, which holds a copy of v at once).
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr, foreach=False)

    def predict_peak(self, micro_batch_size: int, accumulation_steps: int,
                     mode: str = "none") -> int:
        """Predicted peak bytes of a steady-state step with these settings (see the module doc).

        Args:
            micro_batch_size (int): b.
            accumulation_steps (int): K.
            mode (str): one of :data:`PLAYGROUND_MODES`.

        Returns:
            int: bytes, ``predict(Step(...)).total``.

        Raises:
            ValueError: naming the argument.
        """
        choice("mode", mode, PLAYGROUND_MODES)
        return predict(Step(self.config, micro_batch_size, accumulation_steps, mode=mode,
                            gpu=self._gpu)).total

    def cached(self, micro_batch_size: int, accumulation_steps: int,
               mode: str = "none") -> Run | None:
        """The run with these settings if it has been trained, else None.

        Args:
            micro_batch_size (int): as :func:`effective_batch`.
            accumulation_steps (int): as :func:`effective_batch`.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).

        Returns:
            Run or None: the cached run.

        Raises:
            ValueError: naming the parameter, for a bad value.
        """
        effective_batch(micro_batch_size, accumulation_steps)
        choice("mode", mode, PLAYGROUND_MODES)
        return self.cache.get((micro_batch_size, accumulation_steps, mode))

    def run(self, micro_batch_size: int, accumulation_steps: int, mode: str = "none", *,
            on_step: Callable[[int, float], None] | None = None) -> Run:
        """Train (or fetch from the cache) one run with these settings.

        The first optimizer step creates AdamW's state; the second is measured
        (:func:`_step_memory`); the rest train on.

        Args:
            micro_batch_size (int): as :func:`effective_batch`.
            accumulation_steps (int): as :func:`effective_batch`.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).
            on_step (callable, optional): ``on_step(step, loss)``, called after every optimizer step
                of a new run (a widget shows the progress with it).

        Returns:
            Run: the run, cached under its settings.

        Raises:
            ValueError: naming the parameter, for a bad value, or when the effective batch leaves
                fewer than two optimizer steps in ``samples``.
        """
        b = effective_batch(micro_batch_size, accumulation_steps)
        choice("mode", mode, PLAYGROUND_MODES)
        function("on_step", on_step, optional=True)
        key = (micro_batch_size, accumulation_steps, mode)
        if key in self.cache:
            return self.cache[key]
        steps = optimizer_steps(self.samples, micro_batch_size, accumulation_steps)
        if steps < 2:
            raise ValueError(f"micro_batch_size * accumulation_steps must be at most "
                             f"{self.samples // 2} (two optimizer steps in {self.samples} samples), "
                             f"got {b}")
        model, opt = self._model(mode)
        batches = batches_of(*self.data, b)
        kw = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                  on_step=on_step)
        log = train(model, opt, batches[:1], **kw)  # the first step creates AdamW's m and v
        measured = _step_memory(model, opt, batches[1], log=log, **kw)
        train(model, opt, batches[2:], log=log, **kw)
        result = Run(micro_batch_size, accumulation_steps, mode, b, steps,
                     measured_peak=measured,
                     predicted_peak=self.predict_peak(*key),
                     samples_seen=tuple(b * (i + 1) for i in range(log.steps)),
                     losses=tuple(log.losses))
        self.cache[key] = result
        return result


# --------------------------------------------------------------------------- measured cost
#
# Lecture 03's trade-off draws ``predict(step)`` (:mod:`course_lib.prediction.predict`) beside
# what the same step costs when it runs here.


def _best_seconds(fn, repeats: int, device: torch.device, clock: str = "wall") -> float:
    """The fastest seconds of ``repeats`` timed calls of ``fn`` (after one warm-up), on ``clock``."""
    return step_times({"fn": fn}, repeats=repeats, device=device).best(clock)["fn"]


@dataclass(frozen=True)
class MeasuredStep:
    """One optimizer step measured on a device: peak bytes and seconds (best of the steps).

    Attributes:
        peak_bytes (int): resident bytes plus the measured peak of a steady-state step.
        seconds (float): the fastest optimizer step, in seconds.
        device (str): where it ran (``"cpu"``, ``"cuda"``).
    """

    peak_bytes: int
    seconds: float
    device: str


def measure_step_cost(step: Step, *, device: torch.device | str = "cpu", steps: int = 3,
                      clock: str = "wall") -> MeasuredStep:
    """Run ``step`` on ``device`` and measure its peak bytes and seconds.

    Memory: :func:`course_lib.prediction.step_setup.measure_step_memory` (resident bytes plus the
    measured peak of a steady-state step: the CUDA allocator on CUDA, the live-tensor tracker
    elsewhere). Time: the fastest of ``steps`` optimizer steps of
    :func:`course_lib.training.loop.train` after one warm-up step, on the model and optimizer of
    :func:`course_lib.prediction.step_setup.build` (synchronised on CUDA), on ``clock``: the wall
    clock, or with ``"auto"`` this process's CPU time on the CPU (which other work on the
    machine disturbs less) and the wall clock on a GPU.

    Args:
        step (Step): the step (its model, ``b``, ``K``, precision and checkpointing; its ``gpu``
            is what a prediction assumes, ``device`` where this runs).
        device (str or torch.device): where it runs.
        steps (int): timed steps, from 1 to :data:`course_lib.measurement.timing.MAX_RUNS`.
        clock (str): one of :data:`course_lib.measurement.timing.CLOCKS` (see above).

    Returns:
        MeasuredStep: peak bytes and seconds.

    Raises:
        TypeError: for a ``step`` that is not a :class:`~course_lib.prediction.step.Step`.
        ValueError: naming ``device``, ``steps`` or ``clock``, for a bad value, or a lever
            that :func:`~course_lib.prediction.step_setup.measure_step_memory` does not run.
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a course_lib.prediction.step.Step, got "
                             f"{type(step).__name__}")
    steps = positive_int("steps", steps, maximum=MAX_RUNS)
    choice("clock", clock, CLOCKS)
    device = as_device("device", device)
    config, b, K = step.config, step.micro_batch_size, step.accumulation_steps
    peak = measure_step_memory(step, device=device)
    model, optimizer = build(config, precision=step.precision, mode=step.mode, every=step.every,
                             segments=step.segments, foreach=step.foreach, device=device)
    x, y = markov_tokens(b * K, config.seq_len, config.vocab_size, device=device)
    seconds = _best_seconds(lambda: train(model, optimizer, [(x, y)], micro_batch_size=b,
                                          accumulation_steps=K,
                                          **train_options(step.precision, device)),
                            steps, device, clock)
    return MeasuredStep(peak, seconds, str(device))
