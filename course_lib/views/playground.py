"""03: the accumulation playground's back end (short, real, measured training runs), and
:func:`measure_step_cost`, one Step's peak bytes and seconds measured here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.device import resolve_gpu
from course_lib.measurement.memory import peak_memory, resident_bytes
from course_lib.measurement.timing import CLOCKS, MAX_RUNS, step_times
from course_lib.model.gpt import GPT, MAX_SEED, GPTConfig, check_config
from course_lib.model.toy_data import markov_tokens
from course_lib.prediction.predict import Step, predict
from course_lib.prediction.step_setup import build, measure_step_memory, train_options
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

MAX_SAMPLES = MAX_BATCH  # the most samples a playground trains on


def _effective_batch(micro_batch_size: int, accumulation_steps: int) -> int:
    """Samples per optimizer step: ``micro_batch_size * accumulation_steps``, each checked."""
    return positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH) * positive_int(
        "accumulation_steps", accumulation_steps, maximum=MAX_BATCH)


#: The checkpointing modes the playground runs: none, or every block checkpointed.
PLAYGROUND_MODES = ("none", "blocks")


@dataclass(frozen=True)
class _Run:
    """One cached run: settings, losses, a steady-state step's measured and predicted bytes."""

    micro_batch_size: int
    accumulation_steps: int
    mode: str
    measured_peak: int
    predicted_peak: int
    samples_seen: tuple[int, ...]
    losses: tuple[float, ...]


class Playground:
    """Short runs of one GPT ``config`` (default: 4 layers of width 32) on ``samples`` of
    :func:`course_lib.model.toy_data.markov_tokens`, each from the same seed, with a steady-state
    step's bytes measured (resident weights and AdamW's ``m``, ``v`` plus ``peak_memory``) and
    predicted: from ``K = 2`` on, the whole gradient lives through every backward, flat in ``K``.

    Args:
        config (GPTConfig, optional): the model.
        samples (int): the training budget of every run, 1 to :data:`MAX_SAMPLES`.
        lr (float): AdamW's learning rate, the same for every run.
        seed (int): 0 to :data:`course_lib.model.gpt.MAX_SEED`.
        device (str or torch.device): where the runs train.
    Raises:
        ValueError: naming the argument, for a bad value.
    """

    def __init__(self, config: GPTConfig | None = None, *, samples: int = 384, lr: float = 1e-2,
                 seed: int = 0, device: torch.device | str = "cpu"):
        self.config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=4) \
            if config is None else check_config(config)
        self.samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
        self.lr = number("lr", lr, above=0.0)
        self.seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
        self.device = as_device("device", device)
        self._gpu = resolve_gpu("cuda") if self.device.type == "cuda" else None
        self.data = markov_tokens(samples, self.config.seq_len, self.config.vocab_size,
                                  seed=self.seed, device=self.device)
        self.cache: dict[tuple[int, int, bool], _Run] = {}

    def predict_peak(self, micro_batch_size: int, accumulation_steps: int,
                     mode: str = "none") -> int:
        """Predicted peak bytes of a steady-state step: ``predict(Step(...)).total``.

        Args:
            micro_batch_size, accumulation_steps (int): b and K.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).
        Returns:
            int: bytes.
        Raises:
            ValueError: naming the argument, for a bad value.
        """
        choice("mode", mode, PLAYGROUND_MODES)
        return predict(Step(self.config, micro_batch_size, accumulation_steps, mode=mode,
                            gpu=self._gpu)).total

    def cached(self, micro_batch_size: int, accumulation_steps: int,
               mode: str = "none") -> _Run | None:
        """The :class:`_Run` with these settings if it has been trained, else None.

        Args:
            micro_batch_size, accumulation_steps (int): b and K.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).
        Returns:
            _Run or None: the cached run.
        Raises:
            ValueError: naming the argument, for a bad value.
        """
        _effective_batch(micro_batch_size, accumulation_steps)
        choice("mode", mode, PLAYGROUND_MODES)
        return self.cache.get((micro_batch_size, accumulation_steps, mode))

    def run(self, micro_batch_size: int, accumulation_steps: int, mode: str = "none", *,
            on_step: Callable[[int, float], None] | None = None) -> _Run:
        """Train (or fetch from the cache) the :class:`_Run` with these settings (at least two
        optimizer steps in ``samples``), calling ``on_step(step, loss)`` after each step.

        Args:
            micro_batch_size, accumulation_steps (int): b and K.
            mode (str): one of :data:`PLAYGROUND_MODES` (``"blocks"``: every block checkpointed).
            on_step (callable, optional): called after every optimizer step of a new run.
        Returns:
            _Run: the run, cached under its settings.
        Raises:
            ValueError: naming the argument, for a bad value or fewer than two optimizer steps.
        """
        b = _effective_batch(micro_batch_size, accumulation_steps)
        choice("mode", mode, PLAYGROUND_MODES)
        function("on_step", on_step, optional=True)
        key = (micro_batch_size, accumulation_steps, mode)
        if key in self.cache:
            return self.cache[key]
        if self.samples // b < 2:
            raise ValueError(f"micro_batch_size * accumulation_steps must be at most "
                             f"{self.samples // 2} (two optimizer steps in {self.samples} "
                             f"samples), got {b}")
        torch.manual_seed(self.seed)
        model = GPT(self.config).to(self.device)
        if mode != "none":
            enable_checkpointing(model, mode=mode)
        # foreach=False: the per-tensor AdamW whose scratch the engine counts (on CUDA the
        # default is the multi-tensor one, which holds a copy of v at once).
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr, foreach=False)
        batches = batches_of(*self.data, b)
        kw = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                  on_step=on_step)
        log = train(model, opt, batches[:1], **kw)  # the first step creates AdamW's m and v
        measured = resident_bytes(model, opt) + peak_memory(
            lambda: train(model, opt, batches[1:2], log=log, **kw))
        train(model, opt, batches[2:], log=log, **kw)
        self.cache[key] = _Run(*key, measured, self.predict_peak(*key),
                               tuple(b * (i + 1) for i in range(log.steps)), tuple(log.losses))
        return self.cache[key]


@dataclass(frozen=True)
class MeasuredStep:
    """One optimizer step measured: its peak bytes and fastest seconds."""

    peak_bytes: int
    seconds: float


def measure_step_cost(step: Step, *, device: torch.device | str = "cpu", steps: int = 3,
                      clock: str = "wall") -> MeasuredStep:
    """Run ``step`` on ``device`` and measure its peak bytes and seconds (a :class:`MeasuredStep`).

    Memory: :func:`course_lib.prediction.step_setup.measure_step_memory`. Time: the fastest of
    ``steps`` optimizer steps after a warm-up, on ``clock`` (``"auto"``: CPU time on the CPU).

    Args:
        step (Step): the step (its ``gpu`` is what a prediction assumes).
        device (str or torch.device): where it runs.
        steps (int): timed steps, 1 to :data:`course_lib.measurement.timing.MAX_RUNS`.
        clock (str): one of :data:`course_lib.measurement.timing.CLOCKS`.
    Returns:
        MeasuredStep: peak bytes and seconds.
    Raises:
        ValueError: naming the argument, for a bad value or a lever that cannot be measured.
    """
    steps = positive_int("steps", steps, maximum=MAX_RUNS)
    choice("clock", clock, CLOCKS)
    peak = measure_step_memory(step, device=device)  # which checks step and device
    device = as_device("device", device)
    config, b, K = step.config, step.micro_batch_size, step.accumulation_steps
    model, optimizer = build(config, precision=step.precision, mode=step.mode, every=step.every,
                             segments=step.segments, foreach=step.foreach, device=device)
    x, y = markov_tokens(b * K, config.seq_len, config.vocab_size, device=device)
    timed = step_times({"fn": lambda: train(model, optimizer, [(x, y)], micro_batch_size=b,
                                            accumulation_steps=K,
                                            **train_options(step.precision, device))},
                       repeats=steps, device=device)
    return MeasuredStep(peak, timed.best(clock)["fn"])
