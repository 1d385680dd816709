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
* predicted: the memory engine's ``total``
  (:func:`course_lib.prediction.engine.predict_step_memory`, fp32, for the playground's
  device). From ``K = 2`` on the whole gradient is alive during every backward
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
from course_lib.prediction.engine import StepMemory, precision_of, predict_step_memory
from course_lib.prediction.step_setup import build, measure_step_memory, train_options
from course_lib.prediction.time_model import CHECKPOINTING, DeviceSpeed, StepTime, step_time
from course_lib.training.checkpointing import enable_checkpointing
from course_lib.training.loop import batches_of, train
from course_lib.validation import (
    MAX_BATCH,
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
#: The largest ``matmul_size`` :func:`measure_device_speed` times: 16384 (1 GiB in fp32).
MAX_MATMUL = 16384


def effective_batch(micro_batch_size: int, accumulation_steps: int) -> int:
    """Samples per optimizer step: ``micro_batch_size * accumulation_steps``.

    Args:
        micro_batch_size (int): from 1 to :data:`course_lib.validation.MAX_BATCH`.
        accumulation_steps (int): from 1 to :data:`course_lib.validation.MAX_BATCH`.

    Returns:
        int: the product.

    Raises:
        ValueError: naming the parameter, for anything but an int (not a bool) in range.
    """
    return positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH) * positive_int(
        "accumulation_steps", accumulation_steps, maximum=MAX_BATCH)


def optimizer_steps(samples: int, micro_batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in a budget of ``samples``: ``samples // (micro_batch_size * accumulation_steps)``.

    Args:
        samples (int): from 1 to :data:`MAX_SAMPLES`.
        micro_batch_size (int): as :func:`effective_batch`.
        accumulation_steps (int): as :func:`effective_batch`.

    Returns:
        int: the steps (0 when the effective batch exceeds ``samples``).

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
    return samples // effective_batch(micro_batch_size, accumulation_steps)


def _step_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, *,
                log=None, **train_kwargs) -> int:
    """Bytes of one training step on ``batch`` (an ``(inputs, targets)`` pair): resident plus peak.

    :func:`resident_bytes` before the step (weights and whatever optimizer state
    exists) plus :func:`course_lib.measurement.memory.peak_memory` of
    ``course_lib.training.loop.train(model, optimizer, [batch], **train_kwargs)``.
    Run one step first for the steady state (AdamW creates ``m`` and ``v`` in
    its first step).

    Args:
        model (torch.nn.Module): the model.
        optimizer (torch.optim.Optimizer): its optimizer.
        batch (tuple): ``(inputs, targets)`` tensors.
        log (TrainLog, optional): a ``TrainLog`` the step is appended to.
        **train_kwargs: :func:`course_lib.training.loop.train`'s (``micro_batch_size`` is required).

    Returns:
        int: bytes.

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
        predicted_peak (int): the engine's bytes for the same step.
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
        """The engine's peak bytes of a steady-state step with these settings (see the module doc).

        Args:
            micro_batch_size (int): sequences per forward and backward pass.
            accumulation_steps (int): micro-batches per optimizer step.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).

        Returns:
            int: bytes (``predict_step_memory(...).total``).

        Raises:
            ValueError: naming the parameter, for a bad value.
        """
        choice("mode", mode, PLAYGROUND_MODES)
        return predict_step_memory(self.config, micro_batch_size, accumulation_steps,
                                   mode=mode,
                                   gpu=self._gpu).total

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


# --------------------------------------------------------------------------- the trade-off
#
# One optimizer step's cost at a glance: its peak memory (the engine) and its time (the one time
# model, :mod:`course_lib.prediction.time_model`). The widget of lecture 03 § 7 shows both against the
# plain step, one batch of b * K.


def _check_choices(mode: str, precision: str) -> None:
    if mode not in CHECKPOINTING:
        raise ValueError(f"mode must be one of {CHECKPOINTING}, got {mode!r}")
    precision_of(precision)


@dataclass(frozen=True)
class StepCost:
    """What one optimizer step costs, predicted: peak bytes (the engine) and seconds (the time model).

    Attributes:
        micro_batch_size (int): sequences per forward and backward pass (b).
        accumulation_steps (int): micro-batches per optimizer step (K).
        mode (str): the checkpointing mode.
        precision (str): the precision.
        memory (StepMemory): the engine's prediction; its ``total`` is :attr:`peak_bytes`.
        time (StepTime): :func:`course_lib.prediction.time_model.step_time`'s terms.
    """

    micro_batch_size: int
    accumulation_steps: int
    mode: str
    precision: str
    memory: StepMemory
    time: StepTime

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: ``micro_batch_size * accumulation_steps``."""
        return self.micro_batch_size * self.accumulation_steps

    @property
    def peak_bytes(self) -> int:
        """All bytes on the device at the step's peak (``memory.total``)."""
        return self.memory.total

    @property
    def flops(self) -> int:
        """Matmul and attention FLOPs of all K micro-batches, the recomputation included."""
        return self.time.flops

    @property
    def recompute_flops(self) -> int:
        """The recomputation's share of :attr:`flops`."""
        return self.time.recompute_flops

    @property
    def compute_seconds(self) -> float:
        """The FLOPs at the utilised matmul rate."""
        return self.time.compute_seconds

    @property
    def overhead_seconds(self) -> float:
        """The micro-batches' operators: pointwise bytes at the bandwidth, launches, regions."""
        return self.time.pointwise_seconds + self.time.launch_seconds + self.time.transfer_seconds

    @property
    def optimizer_seconds(self) -> float:
        """AdamW's bytes at the bandwidth, and its operators."""
        return self.time.optimizer_seconds

    @property
    def speed(self) -> DeviceSpeed:
        """The device's figures used (``speed.basis``: measured or datasheet)."""
        return self.time.speed

    @property
    def utilisation(self) -> float:
        """The fraction of the matmul rate assumed."""
        return self.time.utilisation

    @property
    def seconds(self) -> float:
        """Seconds per optimizer step: compute, operators and the optimizer."""
        return self.time.seconds

    @property
    def achieved_utilisation(self) -> float:
        """FLOPs per second over the device's matmul rate (model FLOPs utilisation, with the
        recomputation counted)."""
        rate = self.speed.flops(precision_of(self.precision).compute)
        return self.flops / (self.seconds * rate)


def optimizer_step_cost(config: GPTConfig, micro_batch_size: int, accumulation_steps: int, *,
                        mode: str = "none", precision: str = "fp32", gpu=None,
                        speed: DeviceSpeed | None = None,
                        utilisation: float | None = None) -> StepCost:
    """Predicted peak bytes and seconds of one optimizer step of ``K`` micro-batches of ``b``.

    Memory: :func:`course_lib.prediction.engine.predict_step_memory` (steady state; its ``total``). Time:
    :func:`course_lib.prediction.time_model.step_time`, the course's one time model: FLOPs at the matmul
    rate, pointwise and optimizer bytes at the memory bandwidth, operators at a fixed cost each.

    At a fixed effective batch ``B = bK`` the FLOPs and bytes do not change with ``K`` (both are
    linear in ``b``), but the operators grow as ``K``: a micro-batch too small to fill the device
    costs its operators' fixed price anyway. That is the whole of the model's "under-filling",
    and where it is only a model: a real GPU also loses throughput on small matmuls whose tiles
    do not fill its SMs, and overlaps the CPU's dispatch with the GPU's work once kernels are long
    enough. The course measures it on the device it runs on (:func:`measure_step_cost`).

    Args:
        config (GPTConfig): the model (a :class:`~course_lib.model.gpt.GPTConfig`).
        micro_batch_size (int): ``b``, sequences per forward and backward pass.
        accumulation_steps (int): ``K``, micro-batches per optimizer step.
        mode (str): one of :data:`CHECKPOINTING`.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        gpu (str or GPU, optional): where it runs: a preset name of :data:`course_lib.device.GPUS`,
            a :class:`~course_lib.device.GPU`, "cuda", or None/"cpu" (this CPU, measured once).
        speed (DeviceSpeed, optional): the device's figures; default
            :func:`course_lib.prediction.time_model.device_speed` of ``gpu``.
        utilisation (float, optional): in (0, 1]; default ``speed.reached(dtype)``.

    Returns:
        A :class:`StepCost` (``peak_bytes``, ``seconds`` and the terms above).

    Raises:
        ValueError: naming the argument, for anything outside the above.

    Example:
        >>> cost = optimizer_step_cost(GPTConfig(n_layers=2), 4, 8, precision="bf16-mixed",
        ...                            gpu="A100 80GB")
        >>> cost.effective_batch, cost.seconds > cost.compute_seconds
        (32, True)
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    _check_choices(mode, precision)
    card = resolve_gpu(gpu)
    time = step_time(config, b, K, mode=mode, precision=precision, gpu=card,
                     speed=speed, utilisation=utilisation)
    memory = predict_step_memory(config, b, K, precision=precision, mode=mode, gpu=card)
    return StepCost(b, K, mode, precision, memory, time)


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


def measure_step_cost(config: GPTConfig, micro_batch_size: int, accumulation_steps: int, *,
                      mode: str = "none", precision: str = "fp32",
                      device: torch.device | str = "cpu", steps: int = 3,
                      clock: str = "wall") -> MeasuredStep:
    """Run the setting of :func:`optimizer_step_cost` on ``device`` and measure it.

    Memory: :func:`course_lib.prediction.step_setup.measure_step_memory` (resident bytes plus the measured
    peak of a steady-state step: the CUDA allocator on CUDA, the live-tensor tracker
    elsewhere). Time: the fastest of ``steps`` optimizer steps of
    :func:`course_lib.training.loop.train` after one warm-up step, on the model and optimizer of
    :func:`course_lib.prediction.step_setup.build` (synchronised on CUDA), on ``clock``: the wall clock,
    or with ``"auto"`` this process's CPU time on the CPU (which other work on the machine
    disturbs less) and the wall clock on a GPU.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences per forward and backward pass.
        accumulation_steps (int): micro-batches per optimizer step.
        mode (str): one of :data:`CHECKPOINTING`.
        precision (str): one of :data:`course_lib.prediction.formulas.PRECISIONS`.
        device (str or torch.device): where it runs.
        steps (int): timed steps, from 1 to :data:`course_lib.measurement.timing.MAX_RUNS`.
        clock (str): one of :data:`course_lib.measurement.timing.CLOCKS` (see above).

    Returns:
        MeasuredStep: peak bytes and seconds.

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    steps = positive_int("steps", steps, maximum=MAX_RUNS)
    choice("clock", clock, CLOCKS)
    _check_choices(mode, precision)
    device = as_device("device", device)
    peak = measure_step_memory(config, b, K, precision=precision, mode=mode,
                               device=device)
    model, optimizer = build(config, precision=precision, mode=mode, device=device)
    options = train_options(precision, device)
    x, y = markov_tokens(b * K, config.seq_len, config.vocab_size, device=device)
    seconds = _best_seconds(lambda: train(model, optimizer, [(x, y)], micro_batch_size=b,
                                          accumulation_steps=K, **options), steps, device,
                            clock)
    return MeasuredStep(peak, seconds, str(device))
