"""08: the fit ladder: every lever of the course for one model and one GPU, ranked.

:func:`ladder` builds the plain step once (a :class:`~course_lib.prediction.step.Step`) and
replaces one field for each lever; :func:`~course_lib.prediction.predict.predict` gives its peak
bytes and its time (datasheet figures: a prediction, not a measurement). It ranks every lever
alone by bytes saved per time paid, both against the plain step, and adds them in that order
until the step fits the GPU. The chart and the widget of lecture 08 are
:mod:`course_lib.views.ladder_view`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.planning.fit import FIT_POLICIES
from course_lib.prediction import time_model
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import MAX_WORLD_SIZE, mixed_precision_for
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing as ckpt
from course_lib.units import format_bytes
from course_lib.validation import MAX_BATCH, MAX_BYTES, MAX_COUNT, choice, number, positive_int

#: The levers of :func:`ladder`, by group: one setting per group is in force at a time.
LADDER_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss",
                 "optimizer in backward", "optimizer states", "offload activations",
                 "offload optimizer", "LoRA", "ZeRO")
#: Groups that change the job rather than how it runs: LoRA trains other parameters, ZeRO
#: needs more GPUs. The ladder tries them last.
JOB_CHANGING = ("LoRA", "ZeRO")


@dataclass(frozen=True)
class Rung:
    """One lever of :func:`ladder`, applied alone to the plain step.

    Attributes:
        lever (str): the lever's name.
        group (str): one of :data:`LADDER_GROUPS`; levers of one group replace each other in
            the combination (two checkpointing modes, say).
        step (Step): the plain step with this lever.
        memory (StepMemory): its predicted peak moment.
        bytes_saved (int): predicted peak bytes it removes (negative: it adds).
        time_paid (float): the step's predicted time it adds, as a fraction of the plain step's
            (negative: it speeds the step up).
        how (str): "engine" where the memory engine predicts the lever itself, "engine +
            formula" where a closed form adjusts the engine's moments.
    """

    lever: str
    group: str
    step: Step
    memory: StepMemory
    bytes_saved: int
    time_paid: float
    how: str

    @property
    def bytes_per_time(self) -> float:
        """Bytes saved per unit of time paid: per the plain step's whole time (``time_paid``
        1.0); inf for a lever that costs no time."""
        return self.bytes_saved / self.time_paid if self.time_paid > 0 else math.inf


@dataclass(frozen=True)
class Ladder:
    """What :func:`ladder` found: every lever alone, and the combination that fits.

    The combination adds levers one by one until the step is under the GPU's memory.

    Attributes:
        config (GPTConfig): the model.
        gpu (str): the GPU preset's name.
        budget_bytes (int): the memory to fit in, in bytes.
        batch_size (int): sequences per optimizer step.
        seq_len (int): tokens per sequence.
        baseline (StepMemory): the plain step's peak.
        rungs (tuple of Rung): every lever alone, best first (:func:`rank_key`).
        steps (tuple): the combination, lever by lever: ``((lever, StepMemory after adding it,
            time paid so far), ...)``.
        step (Step): the combination.
        fits (bool): whether the combination's peak is within ``budget_bytes``.
        listed (tuple of Rung): the rungs in the course's order, which a chart keeps from one
            setting to the next.
    """

    config: GPTConfig
    gpu: str
    budget_bytes: int
    batch_size: int
    seq_len: int
    baseline: StepMemory
    rungs: tuple
    steps: tuple
    step: Step
    fits: bool
    listed: tuple = ()

    @property
    def memory(self) -> StepMemory:
        """The predicted peak of the combination."""
        return self.steps[-1][1] if self.steps else self.baseline

    def table(self) -> str:
        """The rungs as a text table, in rank order: bytes saved, time paid, bytes per time.

        "per +1 %" is the bytes saved per percent of the plain step's time paid ("free" for a
        lever that costs no time, "-" for one that saves nothing).

        Returns:
            str: a header and one line per rung (at most 98 characters a line).
        """
        w = max(len(r.lever) for r in self.rungs)
        lines = [f"{'lever':{w}s} {'saves':>10s} {'time':>7s} {'per +1 %':>10s} {'peak':>10s}"
                 "  how"]
        for r in self.rungs:
            per = ("-" if r.bytes_saved <= 0 else "free" if r.bytes_per_time == math.inf
                   else format_bytes(r.bytes_per_time / 100))
            lines.append(f"{r.lever:{w}s} {format_bytes(r.bytes_saved):>10s} "
                         f"{r.time_paid:>+7.1%} {per:>10s} {format_bytes(r.memory.total):>10s}"
                         f"  {r.how}")
        return "\n".join(lines)


def _levers(plain: Step, loss_chunk: int, lora_rank: int, world_size: int) -> list:
    """``(lever, group, fields it replaces in the plain step)`` for every rung, in the course's order."""
    half = mixed_precision_for(plain.gpu)
    out = [(f"precision {half}", "precision", dict(precision=half))]
    if plain.batch_size > 1:
        out.append(("accumulation: 1 sequence per micro-batch", "accumulation",
                    dict(micro_batch_size=1, accumulation_steps=plain.batch_size)))
    out += [(f"checkpointing {ckpt.policy_label(mode, every)}", "checkpointing",
             dict(mode=mode, every=every)) for mode, every in FIT_POLICIES[1:]]
    out += [(f"chunked loss ({loss_chunk} tokens)", "chunked loss", dict(loss_chunk=loss_chunk)),
            ("optimizer step in backward", "optimizer in backward", dict(in_backward=True)),
            ("8-bit AdamW states", "optimizer states", dict(state_bits=8)),
            ("4-bit AdamW states", "optimizer states", dict(state_bits=4)),
            ("offload activations (save_on_cpu)", "offload activations",
             dict(offload_activations=True)),
            ("offload optimizer states", "offload optimizer", dict(offload_optimizer=True)),
            (f"LoRA rank {lora_rank} (base frozen)", "LoRA", dict(lora_rank=lora_rank))]
    out += [(f"ZeRO-{z} on {world_size} GPUs", "ZeRO", dict(zero_stage=z, world_size=world_size))
            for z in (1, 2, 3)]
    return out


_ENGINE_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss")


def rank_key(rung: Rung) -> tuple:
    """Where a rung stands on the ladder: sort rungs by this key, best first.

    Bytes saved per time paid, in four bands: levers that save bytes at no time (the most
    time gained first, then the most bytes), then the levers that cost time by bytes saved
    per unit of time paid (:attr:`Rung.bytes_per_time`, the most first), then those that
    save nothing at this setting, and last the job-changing levers (:data:`JOB_CHANGING`) in
    the same order among themselves.

    Args:
        rung (Rung): one lever alone.

    Returns:
        tuple: a sort key.
    """
    free = round(rung.time_paid, 6) <= 0  # rounded: float noise around 0 is no time paid
    return (rung.group in JOB_CHANGING, rung.bytes_saved <= 0, not free,
            round(rung.time_paid, 6) if free else -rung.bytes_per_time, -rung.bytes_saved)


def ladder(config: GPTConfig, gpu: str, *, batch_size: int = 8, seq_len: int | None = None,
           budget_bytes: int | None = None, loss_chunk: int = 1024, lora_rank: int | None = None,
           world_size: int = 8, utilization: float | None = None) -> Ladder:
    """Every lever of the course for training ``config`` on ``gpu``, ranked, and the mix that fits.

    The plain step is fp32 AdamW, the whole batch of ``batch_size`` sequences at once,
    nothing checkpointed, offloaded or sharded: the one baseline of every saving and every
    price. Each lever alone (a :class:`Rung`) is the plain :class:`~course_lib.prediction.step.Step`
    with a field replaced, and :func:`~course_lib.prediction.predict.predict` gives its bytes
    saved and its time paid (as a fraction of the plain step's predicted time: datasheet
    figures, not a measurement); the rungs are ranked by bytes saved per time paid
    (:func:`rank_key`: the levers that cost no time first, the job-changing levers,
    :data:`JOB_CHANGING`: LoRA trains other parameters, ZeRO needs ``world_size`` GPUs,
    last). The combination then adds the rungs in that order, each one only if it lowers the
    predicted peak in the company of those already in (a lever of a group already in
    replaces it if that is lower), until the step fits ``budget_bytes`` (default the GPU's
    :attr:`~course_lib.device.GPU.capacity`).

    Args:
        config (GPTConfig): the model.
        gpu (str): a preset name of :data:`course_lib.device.GPUS`.
        batch_size (int): sequences per optimizer step.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len``.
        budget_bytes (int, optional): device bytes to fit in (default
            ``GPUS[gpu].capacity``).
        loss_chunk (int): tokens per chunk of the chunked loss.
        lora_rank (int, optional): the adapters' rank, from 1 to ``config.d_model`` (None: 16,
            or ``config.d_model`` if smaller).
        world_size (int): GPUs for the ZeRO rungs.
        utilization (float, optional): share of the GPU's peak FLOP/s the step reaches, in
            (0, 1]; None: the time model's figure for the compute dtype.

    Returns:
        Ladder: the rungs, the combination and whether it fits; the same (frozen) object for
        the same arguments, of the last 256 settings asked (a widget moved back redraws at once).

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: naming the argument, for a value out of range.

    Example:
        >>> cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
        >>> result = ladder(cfg, "T4", batch_size=32)
        >>> result.fits, result.rungs[0].time_paid < 0  # the first rung gains time
        (True, True)
        >>> result.step.precision, result.step.micro_batch_size, result.step.accumulation_steps
        ('fp16-mixed', 1, 32)
    """
    choice("gpu", gpu, tuple(GPUS))
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    plain = Step(config, batch_size, seq_len=seq_len, gpu=gpu)
    budget = GPUS[gpu].capacity if budget_bytes is None else positive_int(
        "budget_bytes", budget_bytes, maximum=MAX_BYTES)
    loss_chunk = positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    lora_rank = min(16, config.d_model) if lora_rank is None else positive_int(
        "lora_rank", lora_rank, maximum=config.d_model)
    world_size = positive_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
    speed = None if utilization is None else replace(
        time_model.device_speed(plain.gpu),
        utilisation=number("utilization", utilization, above=0.0, maximum=1.0))
    return _ladder(plain, budget, loss_chunk, lora_rank, world_size, speed)


@functools.lru_cache(maxsize=256)
def _ladder(plain: Step, budget: int, loss_chunk: int, lora_rank: int, world_size: int,
            speed: time_model.DeviceSpeed | None) -> Ladder:
    """:func:`ladder` of checked arguments, cached: the widget asks again for settings seen."""
    base = predict(plain, speed)
    base_time = base.seconds
    rungs, fields = [], {}
    for lever, group, change in _levers(plain, loss_chunk, lora_rank, world_size):
        p = predict(replace(plain, **change), speed)
        fields[lever] = change
        rungs.append(Rung(lever, group, p.step, p.peak, base.total - p.total,
                          p.seconds / base_time - 1,
                          "engine" if group in _ENGINE_GROUPS else "engine + formula"))
    listed = tuple(rungs)
    rungs.sort(key=rank_key)

    current, climbed = base, []
    for rung in rungs:
        if current.total <= budget:
            break
        try:
            trial = predict(replace(current.step, **fields[rung.lever]), speed)
        except ValueError:  # a pair that does not run (optimizer in backward with accumulation)
            continue
        if trial.total < current.total:
            current = trial
            climbed.append((rung.lever, trial.peak, trial.seconds / base_time - 1))
    return Ladder(plain.config, plain.gpu.name, budget, plain.batch_size, plain.seq_len,
                  base.peak, tuple(rungs), tuple(climbed), current.step, current.total <= budget,
                  listed)


__all__ = ["LADDER_GROUPS", "JOB_CHANGING", "Rung", "Ladder", "rank_key", "ladder"]
